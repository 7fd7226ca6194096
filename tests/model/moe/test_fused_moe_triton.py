"""The fused-MoE Triton kernel against FusedExperts' torch path (the reference).

On CPU the kernel runs in Triton's interpreter, in a fresh subprocess with ``TRITON_INTERPRET=1``
set before anything imports triton (as in test_triton_attention), on tiny shapes: top-k > 1 with
softmax, DeepSeek-style (scaled, not summing to 1) and skewed routing weights, biases and gpt-oss's
clamped SwiGLU, a single decode token, sizes that are not multiples of the blocks. The row layout
(``moe_align``) is pure torch and is checked here directly. The kernel is also compiled for sm_80 /
sm_90 with Triton's bundled ptxas, and on a CUDA device the cases run compiled.
"""

from __future__ import annotations

import pytest
import torch

from llmkit.core.model.moe import FusedExperts, grouped_topk, silu_and_mul, softmax_topk
from llmkit.core.model.moe_align import moe_align

from attention_utils import compile_for_cuda, kernel_run_tests, report_runs

# name: (tokens, hidden, intermediate, experts, top_k, routing, bias, activation)
CASES: dict[str, dict] = {
    "silu_k2": dict(t=7, h=32, i=24, e=5, k=2, routing="softmax", bias=False, act="silu"),
    "swiglu_bias_k4": dict(t=5, h=24, i=20, e=8, k=4, routing="softmax", bias=True, act="swiglu"),
    "grouped_k3_scaled": dict(t=6, h=16, i=40, e=8, k=3, routing="grouped", bias=False, act="silu"),
    "decode_t1_k3": dict(t=1, h=40, i=16, e=6, k=3, routing="softmax", bias=True, act="silu"),
    # every token on the same two experts: runs of more than one row block per expert
    "skewed_k2": dict(t=21, h=16, i=16, e=6, k=2, routing="skewed", bias=True, act="swiglu"),
}
RUNS = [f"{n}:float32" for n in CASES] + ["silu_k2:bfloat16", "swiglu_bias_k4:float16"]
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def _build(spec: dict, dtype: torch.dtype, device: str):
    """A FusedExperts with random weights, inputs and routing for ``spec``."""
    from llmkit.plugins.models.gpt_oss import ClampedSwiGLU

    g = torch.Generator().manual_seed(0)
    t, h, i, e, k = (spec[x] for x in "thiek")
    act = silu_and_mul if spec["act"] == "silu" else ClampedSwiGLU(alpha=1.702, limit=0.5)
    experts = FusedExperts(e, h, i, bias=spec["bias"], activation=act)
    experts.w13.data = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(device, dtype)
    experts.w2.data = (torch.randn(e, h, i, generator=g) / i**0.5).to(device, dtype)
    if spec["bias"]:
        experts.b13.data = torch.randn(e, 2 * i, generator=g).to(device, dtype)
        experts.b2.data = torch.randn(e, h, generator=g).to(device, dtype)
    x = torch.randn(t, h, generator=g).to(device, dtype)
    logits = torch.randn(t, e, generator=g).to(device)
    if spec["routing"] == "grouped":
        weights, ids = grouped_topk(logits, k, n_group=4, topk_group=2, renormalize=True, scale=2.5)
    else:
        weights, ids = softmax_topk(logits, k, renormalize=spec["routing"] == "softmax")
    if spec["routing"] == "skewed":
        ids = torch.tensor([[3, 1]] * t, device=device)
    return experts, x, weights, ids


def check_case(name: str, dtype: torch.dtype, device: str) -> None:
    spec = CASES[name]
    experts, x, weights, ids = _build(spec, dtype, device)
    experts.use_triton = False
    want = experts(x, weights, ids)
    experts.use_triton = True
    got = experts(x, weights, ids)
    assert got.shape == want.shape == x.shape and got.dtype == x.dtype
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert scale > 0.1, "a degenerate case: the reference output is ~0"
    assert err <= TOL[dtype] * max(1.0, scale), f"{name}: max abs error {err:.3g} (output scale {scale:.3g})"


def _main(runs: list[str]) -> None:
    """Subprocess entry: the ``name:dtype`` checks under the interpreter, reported as JSON."""
    report_runs(runs, lambda run: check_case(run.split(":")[0], getattr(torch, run.split(":")[1]), "cpu"))


@pytest.mark.parametrize("t,k,e,block_m", [(7, 2, 5, 4), (1, 3, 6, 16), (33, 4, 8, 16), (5, 1, 64, 16)])
def test_moe_align_blocks_hold_one_expert_each(t, k, e, block_m):
    g = torch.Generator().manual_seed(t)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if t == 33:
        ids[:, 0] = 2  # one expert with more than a block of rows
    sorted_ids, block_expert = moe_align(ids, e, block_m)
    n = t * k
    assert sorted_ids.shape == (block_expert.shape[0] * block_m,)
    real = sorted_ids[sorted_ids < n]
    assert sorted(real.tolist()) == list(range(n))  # every (token, slot) exactly once
    flat = ids.reshape(-1)
    seen = []
    for b, expert in enumerate(block_expert.tolist()):
        rows = sorted_ids[b * block_m : (b + 1) * block_m]
        rows = rows[rows < n]
        if expert < 0:
            assert rows.numel() == 0
            continue
        assert rows.numel() > 0 and (flat[rows] == expert).all()
        assert rows.tolist() == sorted(rows.tolist())  # (token, slot) order within an expert
        seen.append(expert)
    assert seen == sorted(seen) and set(seen) == set(flat.tolist())
    assert all(x < 0 for x in block_expert.tolist()[len(seen) :])  # unused blocks only at the end


COMPILE_RUNS = ["float16:90", "bfloat16:90", "bfloat16:80"]


def _compile_main(runs: list[str]) -> None:
    """Subprocess entry (no TRITON_INTERPRET): compile the kernel for ``dtype:arch``."""
    from llmkit.core.model import fused_moe_triton as fm

    def compile_both(run: str) -> None:
        dtype_name, arch = run.split(":")
        t = {"float16": "*fp16", "bfloat16": "*bf16"}[dtype_name]
        for row_div, bias, weight in ((4, True, False), (1, False, True)):
            ptrs = dict.fromkeys(["A", "B", "Bias", "C"], t)
            ptrs.update(topk_weights="*fp32", sorted_ids="*i64", block_expert="*i64")
            bm, bn, bk, warps = fm.moe_config(getattr(torch, dtype_name), 1024, 8)
            consts = dict(A_ROW_DIV=row_div, HAS_BIAS=bias, MUL_WEIGHT=weight, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
            consts.update(UPCAST=False, DOT_PREC=None)
            compile_for_cuda(fm._fused_moe_kernel, arch, ptrs, consts, num_warps=warps, num_stages=2)

    report_runs(runs, compile_both)


kernel_run_tests(globals(), "test_fused_moe_triton", RUNS, COMPILE_RUNS)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_matches_torch(name: str, dtype: torch.dtype) -> None:
    check_case(name, dtype, "cuda")
