"""The LoRA shrink/expand Triton kernels (core/lora/triton_sgmv.py) against LoRALinear's torch path.

On CPU the kernels run in Triton's interpreter, in a fresh subprocess with ``TRITON_INTERPRET=1``
set before anything imports triton (as test_fused_moe_triton does), on small shapes: three adapters
of ranks 1, 4 and 64, one leaving a part of the fused layer out and one adapting only part of it,
base rows, rows of one adapter in several places, an unfused layer one adapter does not adapt at
all, one adapter for every row, and ``in_features`` / ``out_features`` that are not multiples of the
blocks; fp32 and bf16. The row slots come from ``LoRAManager``'s own code. The kernels are also
compiled for sm_80 / sm_90 with Triton's bundled ptxas, and on a CUDA device the cases run compiled
through ``LoRALinear.forward`` (the row slots built by ``LoRAManager.activate`` on the device).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmkit.core.lora.adapter import LoRAAdapter
from llmkit.core.lora.layer import LoRABatch, LoRALinear
from llmkit.core.lora.manager import LoRAManager
from llmkit.core.lora.slot_pool import SlotPool

from attention_utils import compile_for_cuda, kernel_run_tests, report_runs

QKV = [(0, 48), (48, 16), (64, 16)]  # a fused layer's parts: (first output row, rows)
IN = 40
# adapter: (rank, parts of the fused layer it adapts, adapts the unfused layer)
ADAPTERS = {"r4_all": (4, [0, 1, 2], True), "r1_qv": (1, [0, 2], False), "r64_k": (64, [1], True)}
# name: (per segment adapter or None, segment lengths)
CASES = {
    "mixed": (["r1_qv", None, "r4_all", "r64_k", "r4_all", None, "r1_qv"], [3, 2, 1, 2, 2, 1, 1]),
    "decode": (["r64_k", "r4_all", None, "r1_qv", "r4_all"], [1, 1, 1, 1, 1]),
    "one_adapter": (["r4_all", "r4_all"], [3, 2]),
}
LAYERS = ["qkv", "o"]
RUNS = [f"{c}:{layer}:float32" for c in CASES for layer in LAYERS] + ["mixed:qkv:bfloat16", "mixed:o:bfloat16"]
RUNS += ["graph:qkv+o:float32"]
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


class _Base(nn.Module):
    """A base layer whose output is a fixed tensor (the delta is what is checked)."""

    def __init__(self, out: torch.Tensor, in_features: int) -> None:
        super().__init__()
        self.out = out
        self.in_features = self.local_in = in_features
        self.out_features = self.local_out = out.shape[1]
        self.parallel = "replicated"  # one rank: LoRALinear adds the delta on the whole output

    def forward(self, x, deterministic=False):
        return self.out[: x.shape[0]].clone()


def _adapter(name: str, uid: int, layer: str, dtype, device, g) -> LoRAAdapter:
    """Weights laid out as adapter._fuse lays them: stacked A, block-diagonal scaled B."""
    rank, parts, adapts_o = ADAPTERS[name]
    ad = LoRAAdapter(name, "", uid, rank)
    layout = QKV if layer == "qkv" else [(0, IN)]
    used = parts if layer == "qkv" else ([0] if adapts_o else [])
    if not used:
        return ad
    out = sum(rows for _, rows in layout)
    a = torch.randn(len(used) * rank, IN, generator=g) / IN**0.5
    b = torch.zeros(out, len(used) * rank)
    for i, p in enumerate(used):
        dst, rows = layout[p]
        b[dst : dst + rows, i * rank : (i + 1) * rank] = torch.randn(rows, rank, generator=g) / rank**0.5
    ad.weights[layer] = (a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())
    ad.parts[layer] = [layout[p] for p in used]
    return ad


def check_case(case: str, layer: str, dtype: torch.dtype, device: str) -> None:
    g = torch.Generator().manual_seed(0)
    names, q_lens = CASES[case]
    adapters = {n: _adapter(n, i + 1, layer, dtype, device, g) for i, n in enumerate(ADAPTERS)}
    per_segment = [adapters[n] if n else None for n in names]
    rows = sum(q_lens)
    out = 80 if layer == "qkv" else IN
    x = torch.randn(rows, IN, generator=g).to(device, dtype)
    y0 = torch.randn(rows, out, generator=g).to(device, dtype)
    mgr = object.__new__(LoRAManager)  # only activate's state: no model to wrap
    mgr.batch, mgr.max_per_batch, mgr.max_rank = LoRABatch(), 4, 64
    lin = LoRALinear(_Base(y0, IN), layer, mgr.batch)
    assert mgr.activate(per_segment, q_lens, torch.device(device))
    row_slot = mgr.batch.row_slot
    mgr.batch.row_slot = None
    want = lin(x)  # the torch path
    if device == "cpu":
        mgr._slot_rows(per_segment, q_lens, device)
        from llmkit.core.lora.triton_sgmv import add_lora

        stack = mgr.batch.stack(lin)
        got = y0.clone() if stack is None else add_lora(y0.clone(), x, stack, mgr.batch.row_slot)
    else:
        assert row_slot is not None, "activate built no row slots on CUDA"
        mgr.batch.row_slot = row_slot
        got = lin(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    slots = mgr.batch.row_slot.tolist()
    expect = [-1 if a is None else mgr.batch.slots.index(a) for a, n in zip(per_segment, q_lens) for _ in range(n)]
    assert slots == expect
    base = torch.tensor([s < 0 for s in slots], device=device)
    assert torch.equal(got[base], y0[base]), "a row of no adapter changed"
    delta = (want.float() - y0.float()).abs().max().item()
    if delta < 0.05:
        raise AssertionError(f"a degenerate case: the deltas are ~0 ({delta:.3g})")
    err = (got.float() - want.float()).abs().max().item()
    scale = max(1.0, want.float().abs().max().item())
    assert err <= TOL[dtype] * scale, f"max abs error {err:.3g} (output scale {scale:.3g})"
    mgr.deactivate()
    assert mgr.batch.row_slot is None and mgr.batch.slots == ()


def check_graph_replay(dtype: torch.dtype) -> None:
    """A CUDA graph's forward, as its replays see it (the kernels under the interpreter): captured
    with every row's slot at -1 and each layer launched over all its slots, then replayed for
    decode steps of other adapters and fewer rows, with only the static slot buffer and the slots
    changed in between. The graph never asks a layer for its slots: an adapter evicting another's
    slot, in a layer no eager forward wrote yet, must be there before the replay, and the padding
    rows of a smaller step must not keep the last step's slots."""
    g = torch.Generator().manual_seed(3)
    adapters = {}
    for i, n in enumerate(ADAPTERS):
        ad = _adapter(n, i + 1, "qkv", dtype, "cpu", g)
        o = _adapter(n, i + 1, "o", dtype, "cpu", g)
        ad.weights.update(o.weights)
        ad.parts.update(o.parts)
        adapters[n] = ad
    bs = 6
    x = torch.randn(bs, IN, generator=g).to(dtype)
    base = {"qkv": torch.randn(bs, 80, generator=g).to(dtype), "o": torch.randn(bs, IN, generator=g).to(dtype)}
    mgr = object.__new__(LoRAManager)
    mgr.batch, mgr.max_per_batch, mgr.max_rank = LoRABatch(), 2, 64
    layers = {n: LoRALinear(_Base(y, IN), n, mgr.batch) for n, y in base.items()}
    mgr.batch.pool = SlotPool(2, 64)
    mgr.batch.pool.allocate_layers({n: lin.base_layer for n, lin in layers.items()}, dtype, "cpu")
    assert mgr.graphable
    static = torch.full((bs,), -1, dtype=torch.int32)

    def graph_forward() -> dict:  # the captured launches: every slot, the rows' slots from ``static``
        mgr.capture_with(static)
        try:
            return {n: lin(x) for n, lin in layers.items()}
        finally:
            mgr.end_capture()

    captured = graph_forward()
    assert all(torch.equal(captured[n], base[n]) for n in base), "rows of no adapter changed at capture"
    # an eager step through the kernels writes its adapters into the slots of the layers it runs
    eager = [adapters["r4_all"], adapters["r64_k"]]
    mgr._slot_rows(eager, [1, 1], "cpu")
    layers["qkv"](x[:2])
    mgr.deactivate()
    steps = [["r4_all", "r1_qv", None, "r4_all", "r1_qv"], ["r64_k", None, "r4_all"]]  # each evicts a slot
    for names in steps:
        n = len(names)
        per_seg = [adapters[a] if a else None for a in names]
        assert mgr.activate(per_seg, [1] * n, torch.device("cpu"))
        want = {name: lin(x[:n]) for name, lin in layers.items()}  # the grouped torch path
        mgr._slot_rows(per_seg, [1] * n, "cpu")  # (what activate builds on CUDA)
        mgr.stage_for_graph(static, n)
        mgr.deactivate()
        got = graph_forward()
        for name in layers:
            err = (got[name][:n].float() - want[name].float()).abs().max().item()
            assert err <= TOL[dtype] * max(1.0, want[name].float().abs().max().item()), f"{names} {name}: {err:.3g}"
            assert torch.equal(got[name][n:], base[name][n:]), f"{names} {name}: a padding row changed"
            assert not torch.equal(want[name], base[name][:n]), "a degenerate case: no delta"


def _main(runs: list[str]) -> None:
    """Subprocess entry: the ``case:layer:dtype`` checks under the interpreter, reported as JSON."""

    def one(run: str) -> None:
        case, layer, dtype = run.split(":")
        if case == "graph":
            check_graph_replay(getattr(torch, dtype))
            return
        check_case(case, layer, getattr(torch, dtype), "cpu")

    report_runs(runs, one)


def test_slot_keeps_each_output_rows_own_rank_block():
    """A layer's slots (plain torch): B keeps only each output row's own rank block, and the slot
    metadata says where each block's rows are; a layer no adapter of the forward adapts has none."""
    g = torch.Generator().manual_seed(1)
    r4 = _adapter("r4_all", 1, "qkv", torch.float32, "cpu", g)
    r1 = _adapter("r1_qv", 2, "qkv", torch.float32, "cpu", g)
    pool = SlotPool(num_slots=3, max_rank=4)
    assert pool.place([r1, r4]) == {2: 0, 1: 1}
    st = pool.stack("qkv", IN, 80, [0, 1])
    assert st.a.shape == (3, 12, IN) and st.b.shape == (3, 80, 4)  # (3 blocks x rank 4 for an unknown layer)
    assert st.r_total.tolist() == [2, 12, 0] and st.rank.tolist() == [1, 4, 0]
    assert st.lo.tolist() == [[0, 64, 0], [0, 48, 64], [0, 0, 0]]
    assert st.hi.tolist() == [[48, 80, 0], [48, 64, 80], [0, 0, 0]]
    a1, b1 = r1.weights["qkv"]
    assert torch.equal(st.a[0, :2], a1) and not st.a[0, 2:].any()
    assert torch.equal(st.b[0, :48, 0], b1[:48, 0]) and torch.equal(st.b[0, 64:, 0], b1[64:, 1])
    assert not st.b[0, 48:64].any() and not st.b[0, :, 1:].any()
    assert torch.equal(st.b[1, 48:64], r4.weights["qkv"][1][48:64, 4:8])
    r1_o = _adapter("r1_qv", 3, "o", torch.float32, "cpu", g)
    assert pool.stack("o", IN, IN, [pool.place([r1_o])[3]]) is None


def test_slots_stay_put_and_the_least_recently_used_is_evicted():
    """An adapter keeps its slot across forwards (nothing is copied again, the tensors never move:
    what a captured CUDA graph needs); a new one takes an empty slot, then the least recently used
    one no adapter of its forward holds, whose weights are overwritten; an unloaded adapter's slot
    does not keep it alive."""
    import gc

    g = torch.Generator().manual_seed(2)
    a, b, c = (_adapter(n, i + 1, "qkv", torch.float32, "cpu", g) for i, n in enumerate(ADAPTERS))
    pool = SlotPool(num_slots=2, max_rank=64)
    assert pool.place([a]) == {1: 0}
    st = pool.stack("qkv", IN, 80, [0])
    ptrs = (st.a.data_ptr(), st.b.data_ptr(), st.rank.data_ptr())
    assert pool.place([b, a]) == {2: 1, 1: 0}
    assert pool.stack("qkv", IN, 80, [0, 1]) is st
    assert pool.place([c]) == {3: 0}  # slot 0 (a) was used as long ago as slot 1 (b): lowest first
    pool.place([b])
    assert pool.place([c, a]) == {3: 0, 1: 1}  # b, least recently used and not wanted, gives way
    assert pool.stack("qkv", IN, 80, [0, 1]) is st
    assert (st.a.data_ptr(), st.b.data_ptr(), st.rank.data_ptr()) == ptrs
    assert st.rank.tolist() == [64, 4]  # c then a
    assert torch.equal(st.a[1, :12], a.weights["qkv"][0]) and not st.a[1, 12:].any()
    del c
    gc.collect()
    assert pool.owner(0) is None  # the pool holds no adapter alive (unloading frees its uid)
    assert pool.place([b]) == {2: 0}  # the dead adapter's slot is empty: taken first
    with pytest.raises(ValueError, match="2 slots"):
        pool.place([a, b, _adapter("r64_k", 9, "qkv", torch.float32, "cpu", g)])


def test_slots_of_a_model_are_sized_by_its_layers(tmp_path):
    """What the manager allocates on CUDA at start (here on the CPU): each adapted layer's slots,
    A sized for its rank blocks (QKV 3, gate-up 2, the others 1) at the largest rank; an adapter
    placed later is written into those very tensors."""
    from lora_utils import save_adapter
    from model_utils import load_ours, save_tiny_model

    save_tiny_model("llama", tmp_path / "base")
    save_adapter(tmp_path / "base", tmp_path / "ad", seed=1, r=4)
    model = load_ours(tmp_path / "base")
    mgr = LoRAManager(model, max_rank=8, max_per_batch=2)
    pool = SlotPool(2, 8)
    size = pool.allocate_layers(mgr.layers, torch.float32, torch.device("cpu"))
    r_pad = {name.split(".")[-1]: st.a.shape[1] for name, st in pool.stacks.items()}
    assert r_pad == {"qkv_proj": 24, "o_proj": 8, "gate_up_proj": 16, "down_proj": 8}
    assert size == sum(4 * (st.a.numel() + st.b.numel()) for st in pool.stacks.values())
    name = "layers.1.mlp.gate_up_proj"
    before = pool.stacks[name].a.data_ptr()
    adapter = mgr.load("ad", str(tmp_path / "ad"))
    slot = pool.place([adapter])[adapter.uid]
    st = pool.stack(name, 0, 0, [slot])
    assert st.a.data_ptr() == before and st.rank[slot] == 4
    assert torch.equal(st.a[slot, :8], adapter.weights[name][0])


COMPILE_RUNS = ["bfloat16:90", "float16:80", "bfloat16:80"]


def _compile_main(runs: list[str]) -> None:
    """Subprocess entry (no TRITON_INTERPRET): compile both kernels for ``dtype:arch``."""
    from llmkit.core.lora import triton_sgmv as ts

    def compile_both(run: str) -> None:
        dtype_name, arch = run.split(":")
        t = {"float16": "*fp16", "bfloat16": "*bf16"}[dtype_name]
        block_r, block_k, block_n, block_rn = ts._blocks()
        ptrs = dict(X=t, A=t, Tmp="*fp32", row_slot="*i32", r_total="*i32")
        compile_for_cuda(ts._shrink_kernel, arch, ptrs, dict(BLOCK_R=block_r, BLOCK_K=block_k), num_warps=4)
        ptrs = dict(Tmp="*fp32", B=t, Y=t, row_slot="*i32", rank="*i32", lo="*i32", hi="*i32")
        consts = dict(MAX_BLOCKS=ts.MAX_BLOCKS, BLOCK_N=block_n, BLOCK_R=block_rn)
        compile_for_cuda(ts._expand_kernel, arch, ptrs, consts, num_warps=4)

    report_runs(runs, compile_both)


kernel_run_tests(globals(), "test_lora_sgmv_triton", RUNS, COMPILE_RUNS)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_matches_torch(case: str, layer: str, dtype: torch.dtype) -> None:
    check_case(case, layer, dtype, "cuda")
