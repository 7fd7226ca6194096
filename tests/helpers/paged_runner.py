"""Drive a model through the paged KV path the way the engine does, step by step, so tests can
compare every step's logits with transformers: prefills, a prefix shared page-wise with another
sequence (what the radix cache hands out), prefill in chunks, and batched decode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from llmkit.core.kvcache.kv_pool import KVCachePool, ReqToTokenPool
from llmkit.core.model.attention import AttentionMetadata
from llmkit.core.model.causal_lm import ForwardContext
from llmkit.core.model.grouped_attention import build_attention


class PagedRunner:
    def __init__(
        self, model, page_size: int, max_tokens: int = 1024, backend_cls=None, kv_dtype=torch.float32, **backend_kw
    ) -> None:
        from llmkit.plugins.attention.torch_backend import TorchAttentionBackend

        self.model, self.ps = model, page_size
        cpu = torch.device("cpu")
        k_dim, v_dim = model.kv_cache_dims  # as the engine builder sizes the pool and the backend
        shapes = model.kv_layer_shapes
        self.pool = KVCachePool(
            num_layers=model.num_kv_layers,
            num_pages=max_tokens // page_size + 2,
            page_size=page_size,
            num_kv_heads=model.local_kv_heads,
            head_dim=k_dim,
            dtype=kv_dtype,
            device=cpu,
            v_head_dim=v_dim,
            layer_shapes=shapes if len(set(shapes)) > 1 else None,
        )
        if model.attention_scale:
            backend_kw.setdefault("scale", model.attention_scale)
        v_out = backend_kw.pop("v_head_dim", model.attention_v_dim)
        self.req_pool = ReqToTokenPool(8, max_tokens + page_size, cpu)
        cls = backend_cls or TorchAttentionBackend
        self.attn = build_attention(
            cls, shapes, num_heads=model.local_heads, v_out=v_out, pool=self.pool, device=cpu, **backend_kw
        )
        self.seqs: dict[int, list[int]] = {}  # row -> pages
        self.lens: dict[int, int] = {}
        # a hybrid model's state layers: two working slots a row, as the engine keeps them
        specs = model.state_specs(torch.float32)
        if specs:
            from llmkit.core.kvcache.state_pool import StatePool

            self.states = StatePool(specs, 8, 0, cpu)
        else:
            self.states = None

    def new_seq(self, share_from: int | None = None, shared_tokens: int = 0) -> int:
        """A new sequence row; with ``share_from``, its first ``shared_tokens`` (whole pages) reuse
        that sequence's KV pages, as a radix-cache hit does."""
        row = len(self.seqs)
        assert shared_tokens % self.ps == 0
        pages = list(self.seqs[share_from][: shared_tokens // self.ps]) if share_from is not None else []
        self.seqs[row], self.lens[row] = pages, shared_tokens
        if pages:
            self.req_pool.table[row, :shared_tokens] = self.pool.page_slots(pages)
        return row

    def _grow(self, row: int, n: int) -> torch.Tensor:
        old = self.lens[row]
        need = -(-(old + n) // self.ps) - len(self.seqs[row])
        if need > 0:
            pages = self.pool.allocate(need)
            assert pages is not None
            self.seqs[row] += pages
        slots = self.pool.page_slots(self.seqs[row])[old : old + n]
        self.req_pool.table[row, old : old + n] = slots
        self.lens[row] = old + n
        return slots

    def step(
        self, batch: list[tuple[int, list[int]]], deterministic: bool = False, mm=None, lora=None
    ) -> list[torch.Tensor]:
        """One forward over ``(row, new token ids)`` pairs; the logits of each sequence's new tokens.
        ``mm``: the forward's image rows (``ForwardContext.mm``, a vision-language model's);
        ``lora``: its adapter rows (a ``LoRABatch``, set by ``LoRAManager.activate``)."""
        q_lens = [len(ids) for _, ids in batch]
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        positions, slots = [], []
        first = [self.lens[row] for row, _ in batch]
        for row, ids in batch:
            positions.append(torch.arange(self.lens[row], self.lens[row] + len(ids)))
            slots.append(self._grow(row, len(ids)))
        kv_lens = [self.lens[row] for row, _ in batch]
        md = AttentionMetadata(
            num_seqs=len(batch),
            q_lens=q_lens,
            kv_lens=kv_lens,
            q_start_loc=torch.tensor(starts),
            q_lens_t=torch.tensor(q_lens),
            kv_lens_t=torch.tensor(kv_lens),
            req_pool_indices=torch.tensor([row for row, _ in batch]),
            req_to_token=self.req_pool.table,
            out_slots=torch.cat(slots),
            page_size=self.ps,
            is_decode=all(n == 1 for n in q_lens),
            deterministic=deterministic,
            q_starts=starts[:-1] + [starts[-1]],
            req_rows=[row for row, _ in batch],
        )
        md = self.attn.prepare_metadata(md)
        ids = torch.tensor([t for _, toks in batch for t in toks])
        states = None
        if self.states is not None:  # (a shared prefix has no state: hybrid tests share none)
            from llmkit.core.kvcache.state_pool import StateBatch

            states = StateBatch.build(self.states, md.req_rows, first, torch.device("cpu"))
        with torch.inference_mode():
            hidden = self.model(ids, torch.cat(positions), ForwardContext(self.attn, md, lora, mm=mm, states=states))
            logits = self.model.compute_logits(hidden)
        if states is not None:
            self.states.flip(md.req_rows)
        return [logits[starts[i] : starts[i + 1]] for i in range(len(batch))]


def mixed_scenario(model_dir, page_size: int, ids: list[int], kernels: str = "torch") -> list[torch.Tensor]:
    """The logits of every step of: a 32-token prefill of ``ids``; a second sequence sharing those
    32 tokens page-wise, prefilled in chunks (7, 7, 3 tokens) beside the first one's decode steps;
    then two steps of batched decode (``ids`` needs at least 51 tokens). ``kernels="triton"``: the
    triton attention backend and the fused-MoE kernel (only where Triton's interpreter or a GPU
    can run them)."""
    from llmkit.core.model.moe import FusedExperts

    from model_utils import load_ours

    cls = None
    model = load_ours(Path(model_dir))
    if kernels == "triton":
        from llmkit.plugins.attention.triton_backend import TritonAttentionBackend as cls

        for module in model.modules():
            if isinstance(module, FusedExperts):
                module.use_triton = True
    runner = PagedRunner(model, page_size, backend_cls=cls)
    a = runner.new_seq()
    out = list(runner.step([(a, ids[:32])]))
    b = runner.new_seq(share_from=a, shared_tokens=32)
    for chunk, tok in ((ids[32:39], 5), (ids[39:46], 77), (ids[46:49], 300), ([ids[49]], 12), ([ids[50]], 9)):
        out += runner.step([(b, chunk), (a, [tok])])
    return out


def _interpreted_main(args: list[str]) -> None:
    model_dir, page_size, ids, out_path = args
    torch.save(mixed_scenario(model_dir, int(page_size), json.loads(ids), "triton"), out_path)


def mixed_scenario_interpreted(model_dir, page_size: int, ids: list[int], out_path) -> list[torch.Tensor]:
    """:func:`mixed_scenario` on the Triton kernels, in a fresh process running them in Triton's
    interpreter (set before anything imports triton)."""
    here = Path(__file__).resolve().parent
    code = f"import sys; sys.path.insert(0, {str(here)!r}); import paged_runner as p; p._interpreted_main(sys.argv[1:])"
    env = {**os.environ, "TRITON_INTERPRET": "1", "LLMKIT_TRITON_INTERPRET": "1"}
    args = [str(model_dir), str(page_size), json.dumps(ids), str(out_path)]
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out_path)


def assert_close(ours, theirs, tol: float = 1e-4) -> None:
    assert ours.shape == theirs.shape
    assert torch.allclose(ours, theirs, atol=tol, rtol=tol), (ours - theirs).abs().max()


def check_cached_prefix_chunked_decode(model, ref, ids: list[int], page_size: int) -> None:
    """Sequence A prefills ``ids[:32]``. Sequence B reuses those 32 tokens' pages (a radix-cache
    hit), prefills ``ids[32:49]`` in chunks of 7, 7 and 3, each batched with one of A's decode
    steps (A continues differently), then both decode together; every step's logits equal
    transformers' (``ref``) over the whole sequence."""
    with torch.no_grad():
        full = ref(torch.tensor([ids])).logits[0]
    runner = PagedRunner(model, page_size)
    a = runner.new_seq()
    (la,) = runner.step([(a, ids[:32])])
    assert_close(la, full[:32])
    b = runner.new_seq(share_from=a, shared_tokens=32)
    other = [5, 77, 300, 12, 9]
    with torch.no_grad():
        full_a = ref(torch.tensor([ids[:32] + other])).logits[0]
    pos_b, pos_a = 32, 32
    for chunk in (ids[32:39], ids[39:46], ids[46:49]):
        lb, la = runner.step([(b, chunk), (a, [other[pos_a - 32]])])
        assert_close(lb, full[pos_b : pos_b + len(chunk)])
        assert_close(la, full_a[pos_a : pos_a + 1])
        pos_b, pos_a = pos_b + len(chunk), pos_a + 1
    for _ in range(2):  # a pure decode batch
        lb, la = runner.step([(b, [ids[pos_b]]), (a, [other[pos_a - 32]])])
        assert_close(lb, full[pos_b : pos_b + 1])
        assert_close(la, full_a[pos_a : pos_a + 1])
        pos_b, pos_a = pos_b + 1, pos_a + 1
