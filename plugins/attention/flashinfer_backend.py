"""The optional ``flashinfer`` attention backend (``pip install 'llmkit[flashinfer]'``).

Uses FlashInfer's paged-KV wrappers: ``BatchPrefillWithPagedKVCacheWrapper`` for prefill and mixed
batches (causal, bottom-right aligned when a cached prefix precedes the new tokens) and
``BatchDecodeWithPagedKVCacheWrapper`` for decode. Our pool stores each layer's K and V as
``[num_slots, Hkv, D]`` with page p = slots ``p*page_size ...``, which is FlashInfer's "NHD" paged
layout once viewed as ``[num_pages, page_size, Hkv, D]``. A sequence's pages are read from
``req_to_token`` at every ``page_size``-th position (its tokens fill its pages in order).

flashinfer is imported only when this backend is checked or built. CUDA graphs are not wired up
here (the wrappers need their own fixed-size index buffers); use ``triton`` for graph replay.
"""

from __future__ import annotations

import importlib.util

import torch

from llmkit.core.model.attention import AttentionBackend, AttentionMetadata

MISSING = "the flashinfer attention backend needs the 'flashinfer' package: pip install 'llmkit[flashinfer]'"
_WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferAttentionBackend(AttentionBackend):
    """Paged attention through FlashInfer's prefill/decode wrappers (CUDA only)."""

    def __init__(self, **kwargs) -> None:
        """Takes the keyword arguments of AttentionBackend; fails when availability() does."""
        super().__init__(**kwargs)
        reason = self.availability(self.device)
        if reason is not None:
            raise RuntimeError(reason)
        import flashinfer

        workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        # Large or odd GQA groups (e.g. 7) run on the tensor-core decode path, as SGLang does.
        group = self.num_heads // self.num_kv_heads
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=group >= 4)

    @classmethod
    def availability(cls, device: torch.device) -> str | None:
        # The device first: on CPU installing flashinfer would not help, so do not suggest it.
        on_cuda = torch.device(device).type == "cuda"
        if on_cuda and importlib.util.find_spec("flashinfer") is None:
            return MISSING
        if not on_cuda or not torch.cuda.is_available():
            return "the flashinfer attention backend needs a CUDA device; on CPU use: torch"
        return None

    def prepare_metadata(self, md: AttentionMetadata) -> AttentionMetadata:
        ps = md.page_size
        dev = md.req_to_token.device
        kv_lens = md.kv_lens_t
        num_pages = (kv_lens + ps - 1) // ps
        max_pages = max(-(-n // ps) for n in md.kv_lens)
        # Slot of each page's first token, divided by page_size, is the page id.
        firsts = md.req_to_token[md.req_pool_indices, : max_pages * ps : ps]
        valid = torch.arange(max_pages, device=dev)[None, :] < num_pages[:, None]
        indices = (firsts[valid] // ps).to(torch.int32)
        indptr = torch.zeros(md.num_seqs + 1, dtype=torch.int32, device=dev)
        indptr[1:] = torch.cumsum(num_pages, 0)
        last_page_len = (kv_lens - (num_pages - 1) * ps).to(torch.int32)
        # q is cast to the pool's dtype in forward (a --kv-cache-dtype other than the model's
        # runs the kernels in the pool's; fp8 pools are refused by the base contract's check).
        dtype = self.pool.k_buffers[0].dtype
        common = dict(q_data_type=dtype, kv_data_type=dtype, sm_scale=self.scale)
        # plan() syncs with the host once per forward; run() is then reused by every layer.
        if md.is_decode:
            self._decode.plan(
                indptr, indices, last_page_len, self.num_heads, self.num_kv_heads, self.head_dim, ps, **common
            )
        else:
            self._prefill.plan(
                md.q_start_loc.to(torch.int32),
                indptr,
                indices,
                last_page_len,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                ps,
                causal=True,
                **common,
            )
        md.extra["flashinfer_decode"] = md.is_decode
        return md

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, md: AttentionMetadata
    ) -> torch.Tensor:
        k_buf, v_buf = self.pool.k_buffers[layer_id], self.pool.v_buffers[layer_id]
        k_buf.index_copy_(0, md.out_slots, k.to(k_buf.dtype))
        v_buf.index_copy_(0, md.out_slots, v.to(v_buf.dtype))
        shape = (-1, self.pool.page_size, self.num_kv_heads, self.head_dim)
        cache = (k_buf.view(shape), v_buf.view(shape))
        wrapper = self._decode if md.extra["flashinfer_decode"] else self._prefill
        return wrapper.run(q.contiguous().to(k_buf.dtype), cache).to(q.dtype)
