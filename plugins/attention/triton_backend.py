"""The ``triton`` attention backend: our own Triton kernels over the paged KV pool.

Three kernels (``triton_extend``, ``triton_decode``): write the new K/V into their slots, "extend"
attention for prefill and mixed batches (new tokens over a cached prefix plus themselves, causal),
and split-K decode; and a fourth (``triton_rope_store``) that rotates Q/K and writes K/V in one
launch, for models that hand over their fused projection (``forward_qkv``). Decode steps can be captured in CUDA graphs through the backend hooks. Both
attention kernels take a per-layer sliding window and per-head attention sinks (gpt-oss), and a
latent KV (MLA: ``v`` None, the values are the first ``v_head_dim`` channels of the cached keys).

On a CPU the kernels run only in Triton's interpreter, and only when asked for with
``LLMKIT_TRITON_INTERPRET=1`` (slow: for debugging and CI). Order matters there: Triton decides
between the interpreter and the compiler from ``TRITON_INTERPRET`` when ``@triton.jit`` runs, that
is when a kernel module is imported (older Triton releases read it when ``triton`` itself is
imported). So :meth:`TritonAttentionBackend.availability` sets ``TRITON_INTERPRET=1`` before this
backend imports ``triton`` or its kernel modules -- this module imports neither at the top -- and
the constructor checks that the kernels really came out interpreted.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from llmkit.core.model.attention import (
    LATENT_KV,
    SINKS,
    SLIDING_WINDOW,
    TOKEN_SLOTS,
    AttentionBackend,
    AttentionMetadata,
)
from llmkit.core.model.layers import FUSED_ON_CUDA  # (imports no triton)

INTERPRET_ENV = "LLMKIT_TRITON_INTERPRET"
_KERNEL_MODULES = (
    "llmkit.plugins.attention.triton_extend",
    "llmkit.plugins.attention.triton_decode",
    "llmkit.plugins.attention.triton_rope_store",
)


@dataclass
class _Plan:
    """What :meth:`TritonAttentionBackend.prepare_metadata` precomputes (``extra["triton"]``)."""

    decode: bool
    max_q_len: int = 0
    num_splits: int = 1
    mid_o: torch.Tensor | None = None
    mid_lse: torch.Tensor | None = None
    counters: torch.Tensor | None = None


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels; CUDA graphs for decode on CUDA devices."""

    features = frozenset({SLIDING_WINDOW, SINKS, LATENT_KV, TOKEN_SLOTS})
    #: upper bound on the split-K chunks per decode sequence
    max_kv_splits: int = 16

    def __init__(self, **kwargs) -> None:
        """Takes the keyword arguments of AttentionBackend; fails when availability() does."""
        super().__init__(**kwargs)
        reason = self.availability(self.device)
        if reason is not None:
            raise RuntimeError(reason)
        from llmkit.plugins.attention import triton_decode, triton_extend, triton_rope_store

        if self.device.type == "cpu" and not triton_extend.is_interpreted():
            raise RuntimeError(
                "the Triton kernels were imported before TRITON_INTERPRET=1 took effect; set "
                f"{INTERPRET_ENV}=1 (or TRITON_INTERPRET=1) in the environment before starting"
            )
        self._extend, self._decode, self._rope_store = triton_extend, triton_decode, triton_rope_store
        self.supports_cuda_graph = self.device.type == "cuda"
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            self._num_sms = props.multi_processor_count
        else:
            self._num_sms = 4  # the interpreter: enough splits to exercise the merge
        self._graph: dict[str, torch.Tensor] | None = None
        self._graph_deterministic = False
        self._counters: torch.Tensor | None = None  # eager decode's, see _eager_counters

    @classmethod
    def availability(cls, device: torch.device) -> str | None:
        # The device first: on a plain CPU installing triton would not help, so do not suggest it.
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return "no CUDA device is available"
        elif device.type == "cpu" and os.environ.get(INTERPRET_ENV, "") == "1":
            if any(m in sys.modules for m in _KERNEL_MODULES) and not _interpret_set():
                return (
                    "the Triton kernels were already imported in compiled mode; set "
                    f"{INTERPRET_ENV}=1 in the environment before llmkit starts"
                )
            os.environ["TRITON_INTERPRET"] = "1"  # before triton (and so our kernels) is imported
        else:
            return (
                f"the triton attention backend needs a CUDA device, not {device.type} (set "
                f"{INTERPRET_ENV}=1 to run its kernels in Triton's slow CPU interpreter, for "
                "debugging); backends that work on CPU: torch"
            )
        return _triton_missing()

    @classmethod
    def kv_cache_dtype_support(cls, dtype: torch.dtype, device: torch.device) -> str | None:
        # The kernels convert on store (K_buf's element type) and on load (q's dtype), so any
        # float pool works; Triton's fp8 types need Ada/Hopper (and the interpreter's fp8
        # conversions round differently from the hardware's).
        if dtype.itemsize >= 2:
            return None
        device = torch.device(device)
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            return "its fp8 KV cache needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper)"
        return None

    def _num_splits(self, batch: int, deterministic: bool) -> int:
        """Split-K chunks per decode sequence: enough programs to fill the GPU, a power of two.

        A function of the batch size only, so a captured graph's grid is fixed; with
        ``deterministic`` it is constant, so a sequence's result cannot depend on its batch.
        """
        if deterministic:
            return self.max_kv_splits
        programs = batch * self.num_kv_heads
        want = -(-2 * self._num_sms // programs)  # ~2 waves of programs
        splits = 1
        while splits < want and splits < self.max_kv_splits:
            splits *= 2
        return splits

    def prepare_metadata(self, md: AttentionMetadata) -> AttentionMetadata:
        if "triton" in md.extra:  # already prepared (e.g. by prepare_for_capture)
            return md
        if md.is_decode:
            splits = self._num_splits(md.num_seqs, md.deterministic)
            mid_o, mid_lse = self._decode.alloc_split_buffers(
                md.num_seqs, self.num_heads, self.v_head_dim, splits, self.device
            )
            md.extra["triton"] = _Plan(True, 1, splits, mid_o, mid_lse, self._eager_counters(md.num_seqs))
        else:
            md.extra["triton"] = _Plan(False, max(md.q_lens, default=0))
        return md

    def _eager_counters(self, batch: int) -> torch.Tensor:
        """The split counters of eager decode: one buffer kept across steps (the kernel leaves it
        zeroed), grown only when a larger batch needs more, so a step launches no fill kernel. Eager
        launches run one after another on one stream, so they can share it."""
        need = self._decode.counter_count(batch, self.num_heads, self.num_kv_heads, self.head_dim)
        if self._counters is None or self._counters.numel() < need:
            self._counters = self._decode.alloc_counters(need, self.device)
        return self._counters

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        layer_id: int,
        md: AttentionMetadata,
        *,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if sinks is not None:
            sinks = sinks.to(torch.float32).contiguous()
        k_buf = self.pool.k_buffers[layer_id]
        v_buf = None if v is None else self.pool.v_buffers[layer_id]  # latent KV: values in the keys
        self._extend.store_kv(k, v, k_buf, v_buf, md.out_slots)
        return self._attend(q, k_buf, v_buf, md, sliding_window, sinks)

    folds_qkv_bias = True

    def forward_qkv(self, qkv, rope, layer_id, md, bias=None):
        # One kernel rotates Q and K and writes K/V (instead of a rotation, then the K/V store): a
        # decode step runs it once a layer. Only for the plain layout, and with the fused kernels on
        # (LLMKIT_DISABLE_FUSED_KERNELS=1 keeps every model on its torch forms).
        target = self.kv_write_target(layer_id, md)
        if (qkv.is_cuda and not FUSED_ON_CUDA) or target is None:
            return None
        if qkv.shape[1] != (self.num_heads + 2 * self.num_kv_heads) * self.head_dim or qkv.stride(1) != 1:
            return None
        k_buf, v_buf = target
        q = self._rope_store.rope_store_kv(qkv, rope[0], rope[1], self.num_heads, k_buf, v_buf, md.out_slots, bias)
        return self._attend(q, k_buf, v_buf, md, None, None)

    def kv_write_target(self, layer_id, md):
        # the plain layout only (latent KV keeps its values inside the keys)
        if self.v_head_dim != self.head_dim or not self.pool.v_buffers:
            return None
        return self.pool.k_buffers[layer_id], self.pool.v_buffers[layer_id]

    def forward_written(self, q, layer_id, md):
        return self._attend(q, *self.kv_write_target(layer_id, md), md, None, None)

    def _attend(self, q, k_buf, v_buf, md: AttentionMetadata, sliding_window, sinks) -> torch.Tensor:
        plan: _Plan = md.extra["triton"]
        o = q.new_empty(q.shape[0], self.num_heads, self.v_head_dim)
        if plan.decode:
            self._decode.decode_attention(
                q,
                o,
                k_buf,
                v_buf,
                md.req_to_token,
                md.req_pool_indices,
                md.kv_lens_t,
                plan.mid_o,
                plan.mid_lse,
                plan.counters,
                plan.num_splits,
                self.scale,
                sliding_window,
                sinks,
            )
        elif plan.max_q_len > 0:
            self._extend.extend_attention(
                q,
                o,
                k_buf,
                v_buf,
                md.req_to_token,
                md.req_pool_indices,
                md.q_start_loc,
                md.q_lens_t,
                md.kv_lens_t,
                plan.max_q_len,
                self.scale,
                sliding_window,
                sinks,
            )
        return o

    # CUDA graphs. A graph bakes in tensor addresses, so its metadata points at static buffers.
    # It also gets its own compact slot table (row i = the i-th sequence of the batch): replay
    # copies the rows in use from the engine's table, so the graph never depends on which
    # req_to_token rows the scheduler picked, nor on the engine's table object.
    def init_capture_graph(self, max_bs: int, max_context: int, deterministic: bool = False) -> None:
        """Allocate static buffers; ``deterministic`` fixes the split count for every batch size."""
        dev, i64 = self.device, torch.int64
        self._graph_deterministic = deterministic
        splits = self._num_splits(1, deterministic)  # the largest count any batch size uses
        mid_o, mid_lse = self._decode.alloc_split_buffers(max_bs, self.num_heads, self.v_head_dim, splits, dev)
        self._graph = {
            "req_to_token": torch.zeros((max_bs, max_context), dtype=i64, device=dev),
            "req_pool_indices": torch.arange(max_bs, dtype=i64, device=dev),
            "kv_lens": torch.ones(max_bs, dtype=i64, device=dev),
            "q_lens": torch.ones(max_bs, dtype=i64, device=dev),
            "q_start_loc": torch.arange(max_bs + 1, dtype=i64, device=dev),
            "out_slots": torch.zeros(max_bs, dtype=i64, device=dev),  # slot 0 absorbs padding
            "mid_o": mid_o,
            "mid_lse": mid_lse,
            # its own: the graphs bake in its address, and the eager one is re-allocated as it grows
            "counters": self._decode.alloc_counters(
                self._decode.counter_count(max_bs, self.num_heads, self.num_kv_heads, self.head_dim), dev
            ),
        }

    def prepare_for_capture(self, bs: int) -> AttentionMetadata:
        g = self._require_graph(bs)
        splits = self._num_splits(bs, self._graph_deterministic)
        plan = _Plan(True, 1, splits, g["mid_o"][:bs, :, :splits], g["mid_lse"][:bs, :, :splits], g["counters"])
        return AttentionMetadata(
            num_seqs=bs,
            q_lens=[1] * bs,
            kv_lens=[1] * bs,
            q_start_loc=g["q_start_loc"][: bs + 1],
            q_lens_t=g["q_lens"][:bs],
            kv_lens_t=g["kv_lens"][:bs],
            req_pool_indices=g["req_pool_indices"][:bs],
            req_to_token=g["req_to_token"],
            out_slots=g["out_slots"][:bs],
            page_size=self.pool.page_size,
            is_decode=True,
            extra={"triton": plan},
        )

    def prepare_for_replay(self, bs: int, metadata: AttentionMetadata) -> None:
        g = self._require_graph(bs)
        n = metadata.num_seqs
        if not metadata.is_decode or n > bs:
            raise ValueError(f"a decode graph of batch size {bs} cannot run this batch ({n} seqs)")
        max_len = max(metadata.kv_lens)
        if max_len > g["req_to_token"].shape[1]:
            raise ValueError(f"context {max_len} exceeds the captured max_context")
        g["req_to_token"][:n, :max_len] = metadata.req_to_token[metadata.req_pool_indices, :max_len]
        g["kv_lens"][:n] = metadata.kv_lens_t
        g["out_slots"][:n] = metadata.out_slots
        # Padding sequences: one token in slot 0, the reserved page.
        g["kv_lens"][n:bs] = 1
        g["out_slots"][n:bs] = 0
        g["req_to_token"][n:bs, 0] = 0

    def _require_graph(self, bs: int) -> dict[str, torch.Tensor]:
        if self._graph is None:
            raise RuntimeError("init_capture_graph must run before capturing or replaying")
        if bs > self._graph["kv_lens"].shape[0]:
            raise ValueError(f"batch size {bs} exceeds the max_bs given to init_capture_graph")
        return self._graph


def _triton_missing() -> str | None:
    """Why triton cannot be imported (an extra: CPU installs go without it), or None."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # not installed, or a build that does not load here
        return f"the triton attention backend needs the 'triton' package ({exc}): pip install 'llmkit[triton]'"
    return None


def _interpret_set() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"
