"""Executes a scheduled batch: builds the flat input tensors and metadata, runs the model, and
returns logits for the rows that need them."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from llmkit.core.engine.scheduling.scheduled_batch import ScheduledBatch
from llmkit.core.engine.step_wire import StepBroadcaster, StepInputs
from llmkit.core.kvcache.kv_pool import KVCachePool, ReqToTokenPool
from llmkit.core.kvcache.state_pool import StateBatch
from llmkit.core.model.attention import AttentionBackend, AttentionMetadata
from llmkit.core.model.causal_lm import CausalLM, ForwardContext
from llmkit.core.speculative.features import FeatureCapture


@dataclass
class StepOutput:
    sample_logits: torch.Tensor  # [rows, V] in segment order: 1 + len(draft) rows a sampling segment
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
        self.lora = None  # a LoRAManager, when adapters are served
        self.encoder = None  # an EncoderCache, when the model takes images
        # (layers, observe): a speculative proposer reads the target's hidden states at those
        # layers' inputs (EAGLE-3); observe(req, start, rows) gets each segment's after a forward
        self.features: tuple[tuple[int, ...], object] | None = None
        self._captured: torch.Tensor | None = None
        self._moved: list[int] = []  # K/V moved since the last step, for the other ranks (flat pairs)
        self.states = None  # a hybrid model's StatePool
        self.windows = None  # window layers' own pages (core/kvcache/window_pages.py), where kept apart

    def step_inputs(self, batch: ScheduledBatch, chained: list | None = None) -> StepInputs:
        """The batch as plain lists: token ids, positions, lengths, rows, and the rows to sample.

        ``chained``: the requests whose input token is still on the device (the step in flight
        sampled it, see :meth:`Sampler.launch`), in its sampling order. Each gets a placeholder
        id here and ``inp.from_prev`` (the id's index, the pick's row) says where to copy it from."""
        if batch.decode_only:
            inp = self._decode_inputs(batch, chained)
            if inp is not None:
                return inp
        ids, pos, q_lens, kv_lens, rows, sample_rows, prompt_ranges, decoding = [], [], [], [], [], [], [], []
        seg_rows, has_mm, loras, tree_keys = [], False, [], []
        prev = {id(r): i for i, r in enumerate(chained)} if chained else {}
        from_prev: list[tuple[int, int]] = []
        for s in batch.segments:
            start = len(ids)
            seg_rows.append(start)
            has_mm = has_mm or s.req.mm is not None
            if s.req.inflight and id(s.req) in prev:  # a decode step of the token in flight
                from_prev.append((len(ids), prev[id(s.req)]))
                ids.append(0)
            else:
                ids.extend(s.req.token_slice(s.start, s.start + s.length - len(s.draft)))
            ids.extend(s.draft)
            if s.tree is not None:  # the root and every node a one-row sequence (see core/speculative/tree.py)
                _tree_rows(s, len(q_lens), pos, q_lens, kv_lens, rows, decoding, tree_keys)
                loras.extend([s.req.lora] * (1 + len(s.draft)))
            else:
                pos.extend(range(s.start, s.start + s.length))
                q_lens.append(s.length)
                kv_lens.append(s.start + s.length)
                rows.append(s.req.req_pool_idx)
                decoding.append(int(s.length == 1 and s.start >= len(s.req.prompt_ids)))
                loras.append(s.req.lora)
            if s.samples:  # a draft's rows too: each scores the token after it
                sample_rows.extend(range(len(ids) - 1 - len(s.draft), len(ids)))
            if s.req.needs_prompt_logits:
                prompt_ranges.append((start, len(ids)))
        inp = StepInputs(ids, pos, q_lens, kv_lens, rows, sample_rows, prompt_ranges, decoding, from_prev)
        inp.tree_keys = tree_keys
        if self.lora is not None and any(a is not None for a in loras):
            inp.loras = loras  # (per sequence)
        if has_mm:
            from llmkit.core.multimodal.step_rows import plan_images

            inp.images, inp.rope, inp.bidirectional = plan_images(batch.segments, seg_rows, pos)
        return inp

    def _decode_inputs(self, batch: ScheduledBatch, chained: list | None) -> StepInputs | None:
        """:meth:`step_inputs` of a batch whose segments are all one token with no draft, in one
        pass (a decode step of a large batch ran ~10 list appends a request); None for a batch
        with images (their rows take the general path)."""
        segs = batch.segments
        prev = {id(r): i for i, r in enumerate(chained)} if chained else None
        ids: list[int] = []
        pos: list[int] = []
        rows: list[int] = []
        decoding: list[int] = []
        sample_rows: list[int] = []
        prompt_ranges: list[tuple[int, int]] = []
        from_prev: list[tuple[int, int]] = []
        loras = []
        for i, s in enumerate(segs):
            req = s.req
            if req.mm is not None:
                return None
            start = s.start
            prompt, out = req.prompt_ids, req.output_ids
            n_prompt = len(prompt)
            inflight = req.inflight
            if inflight and prev is not None and id(req) in prev:  # its token is in flight
                from_prev.append((i, prev[id(req)]))
                ids.append(0)
            else:
                ids.append(out[start - n_prompt] if start >= n_prompt else prompt[start])
            pos.append(start)
            rows.append(req.req_pool_idx)
            decoding.append(1 if start >= n_prompt else 0)
            if start + 1 == n_prompt + len(out) + inflight:  # (s.samples, inline)
                sample_rows.append(i)
            if req.return_prompt_logprobs and not req.first_prefill_done:
                prompt_ranges.append((i, i + 1))
            loras.append(req.lora)
        n = len(segs)
        kv_lens = [p + 1 for p in pos]
        inp = StepInputs(ids, pos, [1] * n, kv_lens, rows, sample_rows, prompt_ranges, decoding, from_prev)
        if self.lora is not None and any(a is not None for a in loras):
            inp.loras = loras
        return inp

    def upload(self, parts: list) -> list[torch.Tensor]:
        """Int64 vectors (lists or host tensors) on the device. On CUDA in one non-blocking copy from
        pinned memory: a copy from pageable memory makes the host wait for the stream (so for the
        step in flight: nothing left to overlap), ~85-430 us of CPU each, ~11 of them a step before.
        PyTorch's caching host allocator keeps a pinned block until its copy has run."""
        # Lists through numpy: torch.as_tensor of a list of 256 ints costs ~19 us, numpy ~6.
        arrs = [
            p.to(torch.int64).reshape(-1).numpy() if isinstance(p, torch.Tensor) else np.array(p, dtype=np.int64)
            for p in parts
        ]
        if self.device.type != "cuda":
            return [torch.from_numpy(a).to(self.device) for a in arrs]
        dev = torch.from_numpy(np.concatenate(arrs)).pin_memory().to(self.device, non_blocking=True)
        return list(dev.split([a.size for a in arrs]))

    def build_metadata(
        self, inp: StepInputs, picks: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None]:
        """The step's device inputs: token ids, positions, attention metadata, and the rows whose
        logits are sampled (None: every row). The scheduler's slot-table writes travel with them.
        ``picks``: the tokens the step in flight sampled, where ``inp.from_prev`` takes ids from."""
        q_lens, rows = inp.q_lens, inp.rows
        decode = len(inp.ids) == len(rows)  # one token per sequence (fewer ops, same values)
        q_start = list(range(len(rows) + 1)) if decode else [0, *itertools.accumulate(q_lens)]
        parts = [inp.ids, inp.positions, rows, inp.kv_lens, q_start, q_lens]
        sampled = bool(inp.sample_rows) and len(inp.sample_rows) < len(inp.ids)
        if sampled:
            parts.append(inp.sample_rows)
        writes = self.req_pool.take_pending()  # the scheduler's slot writes
        if writes is not None:
            parts.append(writes)
        from_prev = inp.from_prev
        if from_prev:
            parts.append([i for i, _ in from_prev] + [j for _, j in from_prev])
        up = self.upload(parts)
        if from_prev:
            dst, src = up.pop().view(2, -1)
            up[0].index_copy_(0, dst, picks.index_select(0, src))  # queued behind the step that samples them
        if writes is not None:
            self.req_pool.apply(up.pop().view(3, -1))
        sample_idx = up.pop() if sampled else None
        input_ids, positions, rows_t, kv_lens_t, q_start_t, q_lens_t = up
        table = self.req_pool.table
        if inp.tree_keys:  # each node's own slot list: a table of the step's sequences
            table, rows_t, rows = _tree_table(table, rows_t, inp)
        if decode:
            out_slots = table[rows_t, positions]
        else:
            out_slots = table[rows_t.repeat_interleave(q_lens_t), positions]
        md = AttentionMetadata(
            num_seqs=len(rows),
            q_lens=q_lens,
            kv_lens=inp.kv_lens,
            q_start_loc=q_start_t,
            q_lens_t=q_lens_t,
            kv_lens_t=kv_lens_t,
            req_pool_indices=rows_t,
            req_to_token=table,
            out_slots=out_slots,
            page_size=self.pool.page_size,
            is_decode=q_lens.count(1) == len(q_lens),
            deterministic=self.deterministic,
            q_starts=q_start,
            req_rows=rows,
            decoding=list(map(bool, inp.decoding)),
            bidirectional_spans=inp.bidirectional,
        )
        return input_ids, positions, md, sample_idx

    @torch.inference_mode()
    def execute(self, inp: StepInputs, picks: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run one forward: logits of the sampled rows and of each prompt-logprob span. Every
        tensor-parallel rank runs it with the same ``inp`` (the LM head gathers over them)."""
        # Every input reaches the device before the forward is queued: a blocking host-to-device
        # copy after it would wait for the whole forward and leave nothing to overlap.
        input_ids, positions, md, sample_idx = self.build_metadata(inp, picks)
        mm = None
        if inp.images or inp.rope is not None:  # image rows, or M-RoPE positions to rotate by
            mm = self.encoder.forward_inputs(inp.images, inp.rope, len(inp.ids), self.device)
        lora = bool(inp.loras) and self.lora.activate(inp.loras, inp.q_lens, self.device)
        capture = FeatureCapture(self.features[0]) if self.features is not None else None
        states = None
        if self.states is not None:
            starts = [kv - q for kv, q in zip(inp.kv_lens, inp.q_lens)]
            states = StateBatch.build(self.states, md.req_rows, starts, self.device)
        graphed = mm is None and capture is None and states is None and not inp.tree_keys and self.graphs is not None
        graphed = graphed and self.windows is None  # (graphs read one slot table; see stages/windows.py)
        window_md = self._window_metadata(md, positions) if self.windows is not None else None
        try:
            if graphed and (not lora or self.graphs.lora is not None) and self.graphs.can_run(md):
                hidden = self.graphs.replay(input_ids, positions, md)  # (adapter rows: the graph's slots)
            else:
                md = self.attn.prepare_metadata(md)
                ctx = ForwardContext(self.attn, md, self.lora.batch if lora else None, mm, capture, states)
                if window_md is not None:
                    ctx.window_metadata = self.attn.prepare_metadata(window_md)
                    ctx.window_layers = self.windows.layers
                hidden = self.model(input_ids, positions, ctx)
                if capture is not None:
                    self._captured = capture.features()
        finally:
            if lora:
                self.lora.deactivate()
        prompt = [self.model.compute_logits(hidden[a:b], self.deterministic) for a, b in inp.prompt_ranges]
        if inp.sample_rows:
            rows = hidden if sample_idx is None else hidden.index_select(0, sample_idx)
            logits = self.model.compute_logits(rows, self.deterministic)
        else:
            logits = hidden.new_empty((0, 0))
        if states is not None:  # the step succeeded: its written states become current
            self.states.flip(md.req_rows)
        return logits, prompt

    def _window_metadata(self, md: AttentionMetadata, positions: torch.Tensor) -> AttentionMetadata:
        """``md`` over the window layers' own slot table (their new K/V's slots from it too)."""
        table = self.windows.table
        table.flush()  # (the scheduler's writes; a no-op on the CPU)
        t = table.table
        rows = md.req_pool_indices
        if positions.numel() != md.num_seqs:
            rows = rows.repeat_interleave(md.q_lens_t)
        return dataclasses.replace(md, req_to_token=t, out_slots=t[rows, positions], extra={})

    @property
    def can_chain(self) -> bool:
        """Whether a step's inputs may come from the device (not on tensor-parallel rank 0: the
        other ranks get the ids as lists)."""
        return self.broadcaster is None

    def run(self, batch: ScheduledBatch, prev=None) -> StepOutput:
        """``prev``: the :class:`PendingSample` of the step in flight, whose picks are this step's
        input for its requests (only where :attr:`can_chain`)."""
        inp = self.step_inputs(batch, prev.reqs if prev is not None else None)
        if self.broadcaster is None:
            logits, prompt = self.execute(inp, prev.picks if prev is not None else None)
        else:
            if self.lora is not None:  # adapters no request here holds: the other ranks drop them
                inp.lora_freed = self.lora.take_freed()
            inp.kv_moves, self._moved = self._moved, []
            if self.states is not None:
                inp.state_copies = self.states.take_copy_log()
            try:
                self.broadcaster.send(inp, self.req_pool.take_write_log())
                logits, prompt = self.execute(inp)
            except Exception as exc:
                self.broadcaster.fail(exc)
                raise
        segs = batch.segments
        if self._captured is not None:
            self._hand_features(segs)
        if batch.decode_only and len(inp.sample_rows) == len(segs):  # (one row a segment)
            sample_segs = list(segs)
        else:
            sample_segs = [s for s in segs if s.samples]
        wants_prompt = [s for s in segs if s.req.needs_prompt_logits] if inp.prompt_ranges else []
        prompt_logits = {s.req.rid: (s.start, lg) for s, lg in zip(wants_prompt, prompt)}
        return StepOutput(logits, sample_segs, prompt_logits)

    def _hand_features(self, segs) -> None:
        """Each segment's rows of the captured hidden states to the proposer (rows in segment order,
        ``length`` a segment, its draft's included)."""
        feats, self._captured = self._captured, None
        observe = self.features[1]
        row = 0
        for s in segs:
            if s.tree is None:
                observe(s.req, s.start, feats[row : row + s.length])
            else:  # the root's row, then its nodes' (see HiddenStateProposer.observe)
                observe(s.req, s.start, feats[row : row + s.length], s.tree)
            row += s.length

    def move_kv_column(self, row: int, src: int, dst: int) -> None:
        """The K/V of the token at column ``src`` of slot-table row ``row`` to the slot of column
        ``dst``, in every layer (a tree's kept node, to the position it now holds); the other
        tensor-parallel ranks do the same before the next forward."""
        src_slot, dst_slot = (int(x) for x in self.req_pool.host[row, [src, dst]])  # (host: no device sync)
        self.move_kv([src_slot, dst_slot])
        if self.broadcaster is not None:
            self._moved += [src_slot, dst_slot]

    def move_kv(self, pairs: list[int]) -> None:
        """Copy the K/V of each (source slot, destination slot) of the flat ``pairs``. All sources
        are read before any destination is written, which is what copying them in order gives:
        no kept node's destination is a later one's source (see core/speculative/tree.py)."""
        src, dst = torch.tensor(pairs, dtype=torch.int64).view(-1, 2).t().to(self.device)
        for buf in self.pool.k_buffers + self.pool.v_buffers:
            raw = buf.view(torch.uint8)  # (any pool dtype, fp8 included)
            raw.index_copy_(0, dst, raw.index_select(0, src))

    def keep_alive(self) -> None:
        """Between steps, on tensor-parallel rank 0: a heartbeat to the other ranks when idle for a
        while (see :mod:`llmkit.core.engine.step_wire`), so that a lost one is found while idle."""
        if self.broadcaster is not None:
            try:
                self.broadcaster.keep_alive()
            except Exception as exc:
                self.broadcaster.fail(exc)
                raise

    def close(self) -> None:
        """Release the other tensor-parallel ranks (they leave their step loop)."""
        if self.broadcaster is not None:
            self.broadcaster.stop()
            self.broadcaster = None


def _tree_rows(s, first_seq: int, pos, q_lens, kv_lens, rows, decoding, tree_keys) -> None:
    """A tree segment's rows as one-row sequences: the root at its position ``p0``, node ``i`` at
    ``p0 + depth(i)`` over its request's slots up to ``p0`` and its path's (node ``j``'s slot is at
    the request's column ``p0 + 1 + j``)."""
    tree, p0, row = s.tree, s.start, s.req.req_pool_idx
    for i, depth in enumerate([0, *tree.depths()]):  # the root (depth 0), then the nodes
        pos.append(p0 + depth)
        q_lens.append(1)
        kv_lens.append(p0 + depth + 1)
        rows.append(row)
        decoding.append(1)
        if i:
            tree_keys.append((first_seq + i, p0 + 1, [p0 + 1 + j for j in tree.path(i - 1)]))


def _tree_table(table: torch.Tensor, rows_t: torch.Tensor, inp: StepInputs):
    """A slot table with a row per sequence of the step (its request's row, the tree nodes' with
    their paths' slots), the rows indexing it, and their host copy."""
    width = max(inp.kv_lens)
    local = table.index_select(0, rows_t)[:, :width].clone()
    seq, col, src = [], [], []
    for v, first, cols in inp.tree_keys:
        seq.extend([v] * len(cols))
        col.extend(range(first, first + len(cols)))
        src.extend(cols)
    dev = table.device
    seq_t, src_t = torch.tensor(seq, device=dev), torch.tensor(src, device=dev)
    local[seq_t, torch.tensor(col, device=dev)] = table[rows_t.index_select(0, seq_t), src_t]
    n = len(inp.rows)
    return local, torch.arange(n, device=dev), list(range(n))
