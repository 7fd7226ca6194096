"""The attention backend contract.

A backend writes the new tokens' K/V into the paged pool and computes attention of the new queries
over each sequence's whole context (cached prefix + new tokens). The engine builds one
:class:`AttentionMetadata` per forward and passes it to every layer.

Layout shared by every backend:
- ``q``: ``[T, num_heads, head_dim]``; ``k``/``v``: ``[T, num_kv_heads, head_dim]`` for the T new
  tokens of the batch, sequences concatenated in batch order.
- The pool stores K and V per layer as ``[num_slots, num_kv_heads, head_dim]``. A slot holds one
  token; a page is ``page_size`` consecutive slots (page p holds slots ``p*page_size ...``), and slot
  0 (page 0) is never handed out, so it can pad index tensors.
- ``req_to_token[req_pool_indices[i], j]`` is the slot of token j of sequence i.

Beyond causal attention over the whole context, a layer may ask for (a backend lists the ones it
implements in :attr:`AttentionBackend.features`; the engine refuses a model that needs one its
backend lacks, at start-up):
- ``sliding_window``: a query at position p sees only keys at positions ``> p - window``;
- ``sinks``: a learned per-head logit that joins every softmax's denominator without a value
  (gpt-oss), so a head can attend to "nothing".
- ``latent_kv``: ``v`` is None and the values are the first ``v_head_dim`` channels of the keys
  (the pool keeps no V buffers). MLA's absorbed form is MQA over one cached latent per token
  (``kv_lora_rank + qk_rope_head_dim`` channels), its values the ``kv_lora_rank`` ones.
- ``token_slots``: every key is read through its own ``req_to_token`` entry, so a sequence's slots
  need not fill its pages in order (tree drafts give each node its path's slots).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import torch

SLIDING_WINDOW = "sliding_window"
SINKS = "sinks"
LATENT_KV = "latent_kv"
BIDIRECTIONAL_SPANS = "bidirectional_spans"
TOKEN_SLOTS = "token_slots"
ATTENTION_FEATURES = (SLIDING_WINDOW, SINKS, LATENT_KV, BIDIRECTIONAL_SPANS, TOKEN_SLOTS)

if TYPE_CHECKING:
    from llmkit.core.kvcache.kv_pool import KVCachePool


@dataclass
class AttentionMetadata:
    """Per-forward description of the batch (never a global)."""

    num_seqs: int
    q_lens: list[int]  # new tokens per sequence
    kv_lens: list[int]  # context length per sequence after this forward (prefix + new)
    q_start_loc: torch.Tensor  # [B+1] int64 cumulative offsets of each sequence's queries
    q_lens_t: torch.Tensor  # [B] int64 (device)
    kv_lens_t: torch.Tensor  # [B] int64 (device)
    req_pool_indices: torch.Tensor  # [B] int64 rows of req_to_token
    req_to_token: torch.Tensor  # [max_reqs, max_context] int64 slot table
    out_slots: torch.Tensor  # [T] int64 slot each new token's K/V is written to
    page_size: int
    is_decode: bool  # every sequence has exactly one new token
    deterministic: bool = False  # batch-invariant numerics requested
    # Host copies of q_start_loc and req_pool_indices: reading the device tensors back would make
    # the CPU wait for the GPU mid-step. Empty when the builder did not provide them.
    q_starts: list[int] = field(default_factory=list)
    req_rows: list[int] = field(default_factory=list)
    # Per sequence: its new token is a generated one (a decode row), not a prompt token. A prompt's
    # last token alone (a prefix-cache hit) also has one new token. Empty: not provided.
    decoding: list[bool] = field(default_factory=list)
    # Per sequence: [start, end) position spans whose tokens attend to each other both ways (the
    # ``bidirectional_spans`` feature); empty: causal everywhere.
    bidirectional_spans: list[list[tuple[int, int]]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # backend-private precomputed tensors


class AttentionBackend(ABC):
    """Computes paged attention for one model; one instance per engine."""

    #: whether decode steps may be captured in CUDA graphs through the hooks below
    supports_cuda_graph: bool = False
    #: the optional features of :data:`ATTENTION_FEATURES` that :meth:`forward` implements
    features: frozenset[str] = frozenset()

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        pool: "KVCachePool",
        device: torch.device,
        scale: float | None = None,
        v_head_dim: int | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim  # the output's head size
        self.pool = pool
        self.device = device
        self.scale = scale if scale is not None else head_dim**-0.5

    @classmethod
    def availability(cls, device: torch.device) -> str | None:
        """Return None if the backend can run on ``device``, else the reason it cannot."""
        return None

    def prepare_metadata(self, metadata: AttentionMetadata) -> AttentionMetadata:
        """Precompute backend-specific tensors once per forward (stored in ``metadata.extra``)."""
        return metadata

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        metadata: AttentionMetadata,
        *,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write ``k``/``v`` to the pool at ``metadata.out_slots`` and return ``[T, H, v_head_dim]`` outputs.

        ``sliding_window`` and ``sinks`` (``[H]`` fp32 logits, this rank's heads) are passed only
        by models that need them, and only to a backend whose :attr:`features` name them."""

    #: whether :meth:`forward_qkv` takes ``bias=`` (the projection's bias, not yet added to ``qkv``)
    folds_qkv_bias: bool = False

    def forward_qkv(
        self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layer_id: int, metadata: AttentionMetadata
    ) -> torch.Tensor | None:
        """Optional fast path: :meth:`forward` straight from a fused projection ``qkv [T, (H + 2 Hkv) D]``
        whose queries and keys are not rotated yet, rotating them with ``rope`` (a
        :meth:`RotaryEmbedding.table`: ``cos2, sin2 [T, 1, D]``) exactly as ``RotaryEmbedding.rotate``
        would. None: not taken here (the default); the caller rotates, splits and calls :meth:`forward`.
        A decode step calls attention once a layer, so one fused call instead of the rotation, the
        views and the K/V writes is worth ~20 us a layer on a CPU."""
        return None

    def kv_write_target(self, layer_id: int, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Optional: this layer's pool buffers ``(k_buf, v_buf)`` ``[slots, Hkv, D]``, where a fused
        projection kernel may write the forward's new keys (rotated) and values itself, at
        ``metadata.out_slots`` in the pool's dtype, and then call :meth:`forward_written` (a decode
        step's QKV product, rotation and K/V store as one kernel). None (the default): not offered."""
        return None

    def forward_written(self, q: torch.Tensor, layer_id: int, metadata: AttentionMetadata) -> torch.Tensor:
        """:meth:`forward` for rotated queries ``q [T, H, D]`` whose keys and values the caller wrote
        into :meth:`kv_write_target`'s buffers."""
        raise NotImplementedError(f"{type(self).__name__} offers no kv_write_target")

    def native_attend(self, rope: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata):
        """Optional: :meth:`forward_qkv` for a C caller (``core/model/cpu/cpu_decoder.c``), as a
        :class:`~llmkit.core.model.cpu.cpu_decoder.NativeAttend` valid for this forward: a function
        ``void fn(const void *ctx, int64_t layer, const float *qkv, int64_t qkv_row, float *out)``
        taking the fp32 fused projection ``qkv [T, (H + 2 Hkv) D]`` (rows ``qkv_row`` floats
        apart, Q and K not rotated) and writing ``out [T, H, D]``, numbers identical to
        :meth:`forward_qkv`'s. None (the default): not offered; the model runs its Python layers."""
        return None

    @classmethod
    def kv_cache_dtype_support(cls, dtype: torch.dtype, device: torch.device) -> str | None:
        """Return None if :meth:`forward` can keep the pool's K/V in ``dtype`` (converting on write
        and on read) on ``device``, else the reason it cannot. The default: any 16- or 32-bit float."""
        if dtype.itemsize < 2:
            return f"it cannot keep the KV cache in {str(dtype).removeprefix('torch.')}"
        return None

    @classmethod
    def check_features(cls, needed: Iterable[str], name: str) -> None:
        """Raise if the model needs an attention feature this backend does not implement."""
        missing = sorted(set(needed) - set(cls.features))
        if missing:
            raise ValueError(
                f"attention backend '{name}' does not implement {', '.join(missing)}, which this model (or "
                "--speculative-eagle-topk above 1: token_slots) needs; "
                "use --attention torch"
            )

    # CUDA-graph hooks: graphs are part of the backend contract, not a special case in the runner.
    def init_capture_graph(self, max_bs: int, max_context: int, deterministic: bool = False) -> None:
        """Allocate the static buffers that captured decode graphs read from. ``deterministic``
        (``--enable-deterministic-inference``): every captured batch size must reduce in the same
        order, so a sequence's result does not depend on which graph replays it."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_capture(self, bs: int) -> AttentionMetadata:
        """Return metadata pointing at static buffers for capturing a decode graph of ``bs`` seqs."""
        raise NotImplementedError

    def prepare_for_replay(self, bs: int, metadata: AttentionMetadata) -> None:
        """Copy this step's metadata into the static buffers before replaying a graph of size bs."""
        raise NotImplementedError
