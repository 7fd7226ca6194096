"""Executes a scheduled batch: builds the flat input tensors and metadata, runs the model, and
returns logits for the rows that need them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmkit.core.engine.scheduler import ScheduledBatch
from llmkit.core.engine.step_wire import StepBroadcaster, StepInputs
from llmkit.core.kvcache.kv_pool import KVCachePool, ReqToTokenPool
from llmkit.core.model.attention import AttentionBackend, AttentionMetadata
from llmkit.core.model.causal_lm import CausalLM, ForwardContext


@dataclass
class StepOutput:
    sample_logits: torch.Tensor  # [num sampling segments, V], in segment order
    sample_segments: list  # the segments whose next token is sampled
    prompt_logits: dict  # rid -> (start position, logits [L, V]) for prompt-logprob requests


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        attn: AttentionBackend,
        pool: KVCachePool,
        req_pool: ReqToTokenPool,
        device: torch.device,
        deterministic: bool,
    ) -> None:
        self.model = model
        self.attn = attn
        self.pool = pool
        self.req_pool = req_pool
        self.device = device
        self.deterministic = deterministic
        self.graphs = None  # a CudaGraphRunner, when decode steps replay CUDA graphs
        self.broadcaster: StepBroadcaster | None = None  # rank 0 of a tensor-parallel group

    def step_inputs(self, batch: ScheduledBatch) -> StepInputs:
        """The batch as plain lists: token ids, positions, lengths, rows, and the rows to sample."""
        ids, pos, q_lens, kv_lens, rows, sample_rows, prompt_ranges, decoding = [], [], [], [], [], [], [], []
        for s in batch.segments:
            start = len(ids)
            ids.extend(s.req.token_slice(s.start, s.start + s.length))
            pos.extend(range(s.start, s.start + s.length))
            q_lens.append(s.length)
            kv_lens.append(s.start + s.length)
            rows.append(s.req.req_pool_idx)
            decoding.append(int(s.length == 1 and s.start >= len(s.req.prompt_ids)))
            if s.samples:
                sample_rows.append(len(ids) - 1)
            if s.req.needs_prompt_logits:
                prompt_ranges.append((start, len(ids)))
        return StepInputs(ids, pos, q_lens, kv_lens, rows, sample_rows, prompt_ranges, decoding)

    def build_metadata(self, inp: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        self.req_pool.flush()  # the scheduler's slot writes, in one copy
        q_lens, rows = inp.q_lens, inp.rows
        dev = self.device
        input_ids = torch.tensor(inp.ids, dtype=torch.int64, device=dev)
        positions = torch.tensor(inp.positions, dtype=torch.int64, device=dev)
        rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
        table = self.req_pool.table
        if len(inp.ids) == len(rows):  # decode: one token per sequence (fewer ops, same values)
            q_start = list(range(len(rows) + 1))
            q_start_t = torch.arange(len(rows) + 1, dtype=torch.int64, device=dev)
            q_lens_t = torch.ones(len(rows), dtype=torch.int64, device=dev)
            out_slots = table[rows_t, positions]
        else:
            q_start = [0]
            for n in q_lens:
                q_start.append(q_start[-1] + n)
            q_start_t = torch.tensor(q_start, dtype=torch.int64, device=dev)
            q_lens_t = torch.tensor(q_lens, dtype=torch.int64, device=dev)
            out_slots = table[rows_t.repeat_interleave(q_lens_t), positions]
        md = AttentionMetadata(
            num_seqs=len(rows),
            q_lens=q_lens,
            kv_lens=inp.kv_lens,
            q_start_loc=q_start_t,
            q_lens_t=q_lens_t,
            kv_lens_t=torch.tensor(inp.kv_lens, dtype=torch.int64, device=dev),
            req_pool_indices=rows_t,
            req_to_token=table,
            out_slots=out_slots,
            page_size=self.pool.page_size,
            is_decode=all(n == 1 for n in q_lens),
            deterministic=self.deterministic,
            q_starts=q_start,
            req_rows=rows,
            decoding=[bool(d) for d in inp.decoding],
        )
        return input_ids, positions, md

    @torch.inference_mode()
    def execute(self, inp: StepInputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run one forward: logits of the sampled rows and of each prompt-logprob span. Every
        tensor-parallel rank runs it with the same ``inp`` (the LM head gathers over them)."""
        input_ids, positions, md = self.build_metadata(inp)
        # Copied to the device before the forward is queued: a blocking host-to-device copy after
        # it would wait for the whole forward and leave nothing to overlap.
        sample_idx = None  # None with sample_rows: every row samples (decode), no gather needed
        if inp.sample_rows and len(inp.sample_rows) < len(inp.ids):
            sample_idx = torch.tensor(inp.sample_rows, dtype=torch.int64, device=self.device)
        if self.graphs is not None and self.graphs.can_run(md):
            hidden = self.graphs.replay(input_ids, positions, md)
        else:
            md = self.attn.prepare_metadata(md)
            hidden = self.model(input_ids, positions, ForwardContext(self.attn, md))
        prompt = [self.model.compute_logits(hidden[a:b], self.deterministic) for a, b in inp.prompt_ranges]
        if inp.sample_rows:
            rows = hidden if sample_idx is None else hidden.index_select(0, sample_idx)
            logits = self.model.compute_logits(rows, self.deterministic)
        else:
            logits = hidden.new_empty((0, 0))
        return logits, prompt

    def run(self, batch: ScheduledBatch) -> StepOutput:
        inp = self.step_inputs(batch)
        if self.broadcaster is None:
            logits, prompt = self.execute(inp)
        else:
            try:
                self.broadcaster.send(inp, self.req_pool.take_write_log())
                logits, prompt = self.execute(inp)
            except Exception as exc:
                self.broadcaster.fail(exc)
                raise
        sample_segs = [s for s in batch.segments if s.samples]
        wants_prompt = [s for s in batch.segments if s.req.needs_prompt_logits]
        prompt_logits = {s.req.rid: (s.start, lg) for s, lg in zip(wants_prompt, prompt)}
        return StepOutput(logits, sample_segs, prompt_logits)

    def close(self) -> None:
        """Release the other tensor-parallel ranks (they leave their step loop)."""
        if self.broadcaster is not None:
            self.broadcaster.stop()
            self.broadcaster = None
