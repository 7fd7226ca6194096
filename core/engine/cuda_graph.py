"""Decode steps replayed from captured CUDA graphs, one graph per batch-size bucket.

Capture goes through the attention backend's hooks (``init_capture_graph``, ``prepare_for_capture``,
``prepare_for_replay``), so any backend that implements them gets graphs; the runner only owns the
static input buffers and the graphs. A batch of ``n`` sequences replays the smallest bucket
``>= n``; padding rows write their K/V to the reserved slot 0.

With LoRA adapters served through the Triton kernels, the graphs are captured with each row's
adapter slot in a static buffer and every layer's launches over all slots (rows of no adapter
return at once), so a decode step mixing adapters replays too (as SGLang's LoRA graphs do).
"""

from __future__ import annotations

import logging

import torch

from llmkit.core.model.attention import AttentionBackend, AttentionMetadata
from llmkit.core.model.causal_lm import CausalLM, ForwardContext

log = logging.getLogger("llmkit")


def batch_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_bs`` (SGLang captures a similar ladder)."""
    out = [b for b in (1, 2, 4) if b <= max_bs]
    out += list(range(8, max_bs + 1, 8))
    if max_bs not in out:
        out.append(max_bs)
    return sorted(set(out))


class CudaGraphRunner:
    def __init__(
        self,
        model: CausalLM,
        attn: AttentionBackend,
        *,
        max_bs: int,
        max_context: int,
        device: torch.device,
        deterministic: bool = False,
        lora=None,
    ) -> None:
        if not attn.supports_cuda_graph:
            raise ValueError(f"{type(attn).__name__} does not support CUDA graphs")
        self.model, self.attn, self.device = model, attn, device
        self.buckets = batch_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        # a LoRAManager whose adapter rows the graphs replay, and each row's slot for them
        self.lora = lora if lora is not None and lora.graphable else None
        self.lora_rows = None if self.lora is None else torch.full((self.max_bs,), -1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        attn.init_capture_graph(self.max_bs, max_context, deterministic=deterministic)

    @torch.inference_mode()
    def capture(self) -> None:
        from tqdm import tqdm

        pool = None
        # the static buffers (zeroed split counters among them) were written on the default stream
        torch.cuda.synchronize(self.device)
        stream = torch.cuda.Stream(self.device)
        # Largest first, so smaller graphs reuse the memory pool of the largest.
        bar = tqdm(reversed(self.buckets), total=len(self.buckets), desc="Capturing batches")
        for bs in bar:
            bar.set_description(f"Capturing batches (bs={bs})")
            md = self.attn.prepare_for_capture(bs)
            lora = None if self.lora is None else self.lora.capture_with(self.lora_rows[:bs])
            ctx = ForwardContext(self.attn, md, lora)
            ids, pos = self.input_ids[:bs], self.positions[:bs]
            try:
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm up kernels (autotuning, lazy init) outside the graph
                        self.model(ids, pos, ctx)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self.model(ids, pos, ctx)
            finally:
                if self.lora is not None:
                    self.lora.end_capture()
            pool = graph.pool()
            self.graphs[bs], self.outputs[bs] = graph, out
        torch.cuda.synchronize(self.device)
        log.info("Captured CUDA graphs for batch sizes %s%s", self.buckets, " (with LoRA slots)" if self.lora else "")

    def can_run(self, md: AttentionMetadata) -> bool:
        return md.is_decode and md.num_seqs <= self.max_bs and not md.extra

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        n = md.num_seqs
        bs = next(b for b in self.buckets if b >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.input_ids[n:bs].zero_()
        self.positions[n:bs].zero_()
        if self.lora is not None:
            self.lora.stage_for_graph(self.lora_rows[:bs], n)
        self.attn.prepare_for_replay(bs, md)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
