"""The fused decode GEMV of :mod:`llmkit.core.model.triton_gemv` (a few rows times a weight, with
residual add + RMSNorm or SiLU-and-mul folded in front) against the torch forms it replaces.

On CPU the kernel runs in Triton's interpreter in fresh subprocesses, and is compiled for sm_80 /
sm_90 with Triton's bundled ptxas (no register spills, and the weight read in 16-byte loads, at every
configuration the dispatch picks); on a CUDA device the same cases run compiled (marked ``gpu``).

Reference: the unfused forms' roundings (the norm's or SiLU-and-mul's output rounded to the
activations' dtype once, as ``triton_pointwise`` rounds it), then the product in fp64. Bounds as in
``test_fused_ops``: one rounding of the output relative to its largest value. A row's result does
not depend on the other rows of the call, and a tiny Qwen2's logits with every block on the fused
GEMVs equal the unfused forms' within fp32 noise.
"""

from __future__ import annotations

import torch

from attention_utils import assert_close_to_largest, compile_for_cuda, kernel_run_tests, report_runs

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = ("float32", "float16", "bfloat16")
OPS = ("plain", "norm", "norm_residual", "silu_mul")
RUNS = [f"{op}:{dt}" for op in OPS for dt in DTYPES]
RUNS += ["rows_do_not_depend_on_the_batch", "tiny_model_logits"]
# (rows, N, K): one row and the most rows, widths that are not powers of two or multiples of a block
SHAPES = ((1, 96, 64), (4, 40, 100), (3, 300, 520), (0, 16, 16))
WIDE = (2, 4096, 72)  # the 16-column blocks of wide projections (slow to interpret: fp32 runs only)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert_close_to_largest(got, want, dtype, what, TOL)


def _inputs(rows: int, n: int, k: int, dtype: torch.dtype, device: str, width: int | None = None):
    x = torch.randn(rows, width or k, generator=_gen(1)).to(device, dtype)
    w = (torch.randn(n, k, generator=_gen(2)) / k**0.5).to(device, dtype)
    return x, w


def check_op(op: str, dtype: torch.dtype, device: str) -> None:
    from llmkit.core.model import triton_gemv

    for rows, n, k in SHAPES + ((WIDE,) if dtype == torch.float32 else ()):
        x, w = _inputs(rows, n, k, dtype, device, 2 * k if op == "silu_mul" else None)
        what = f"{op} {rows}x{k} @ {n}x{k}"
        if op == "plain":
            _close(triton_gemv.gemv(x, w), x.double() @ w.double().T, dtype, what)
        elif op == "silu_mul":
            g, u = x.double().split(k, -1)
            inp = (torch.nn.functional.silu(g) * u).to(dtype)  # rounded once, as silu_mul rounds it
            _close(triton_gemv.gemv(x, w, silu_mul=True), inp.double() @ w.double().T, dtype, what)
        else:
            nw = (1 + 0.1 * torch.randn(k, generator=_gen(3))).to(device, dtype)
            r = torch.randn(rows, k, generator=_gen(4)).to(device, dtype) if op == "norm_residual" else None
            s = x if r is None else x + r  # the residual sum, rounded as the unfused form rounds it
            sd = s.double()
            inp = (sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double()).to(dtype)
            got = triton_gemv.gemv(x, w, norm=(nw, 1e-6), residual=r)
            if r is not None:
                got, total = got
                if dtype == torch.bfloat16 and device == "cpu":  # the interpreter's bf16 cast truncates
                    torch.testing.assert_close(total, s, rtol=2**-7, atol=0)
                else:
                    assert torch.equal(total, s), "the residual sum is the unfused x + residual"
            _close(got, inp.double() @ w.double().T, dtype, what)


def check_rows_do_not_depend_on_the_batch(device: str) -> None:
    from llmkit.core.model import triton_gemv

    x, w = _inputs(4, 300, 520, torch.bfloat16, device)
    r = torch.randn(4, 520, generator=_gen(5)).to(device, torch.bfloat16)
    nw = torch.randn(520, generator=_gen(6)).to(device, torch.bfloat16)
    full = triton_gemv.gemv(x, w, norm=(nw, 1e-5), residual=r)[0]
    gu, wd = _inputs(4, 96, 260, torch.bfloat16, device, 520)
    full_silu = triton_gemv.gemv(gu, wd, silu_mul=True)
    for lo, hi in ((0, 1), (1, 3), (3, 4)):
        assert torch.equal(triton_gemv.gemv(x[lo:hi], w, norm=(nw, 1e-5), residual=r[lo:hi])[0], full[lo:hi])
        assert torch.equal(triton_gemv.gemv(gu[lo:hi], wd, silu_mul=True), full_silu[lo:hi])


def check_tiny_model_logits(device: str) -> None:
    """A tiny Qwen2 (QKV bias, tied embeddings) run on three tokens, every block on the fused
    GEMVs, equals its torch forms' logits (fp32: the C kernels stay off)."""
    import tempfile
    from pathlib import Path

    from llmkit.core.model import layers, triton_gemv, triton_pointwise
    from llmkit.core.model.cpu import cpu_norm, cpu_pointwise
    from llmkit.plugins.attention import cpu_attention

    from model_utils import load_ours, save_tiny_model
    from tests.model.test_reference_transformers import _prefill_logits

    with tempfile.TemporaryDirectory() as d:
        save_tiny_model("qwen2", Path(d))
        model = load_ours(Path(d)).to(device)
    ids = [3, 17, 40]
    on_device = torch.device(device)
    cpu_norm.usable = lambda x, w: False
    cpu_pointwise._usable = lambda x: False
    cpu_attention.available = lambda *args, **kwargs: False
    layers._fused = lambda x: triton_pointwise  # the interpreter stands in for CUDA
    want = _prefill_logits(model, ids, on_device)
    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return triton_gemv.gemv(*args, **kwargs)

    layers.decode_gemv = lambda x: type("G", (), {"gemv": staticmethod(counted)})
    got = _prefill_logits(model, ids, on_device)
    assert calls[0] == 4 * len(model.layers), calls
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, err


def run_case(run: str, device: str) -> None:
    if ":" in run:
        op, dt = run.split(":")
        return check_op(op, getattr(torch, dt), device)
    globals()[f"check_{run}"](device)


def _main(runs: list[str]) -> None:
    from llmkit.core.model import triton_gemv

    assert type(triton_gemv._gemv_kernel).__name__ == "InterpretedFunction"
    report_runs(runs, lambda run: run_case(run, "cpu"))


COMPILE_RUNS = ["bfloat16:80", "bfloat16:90", "float16:90"]


def _compile_main(runs: list[str]) -> None:
    from llmkit.core.model import triton_gemv as tg

    def compile_all(run: str) -> None:
        dtype, arch = run.split(":")
        t = {"float16": "*fp16", "bfloat16": "*bf16"}[dtype]
        ptrs = dict(X=t, R=t, NW=t, W=t, Y=t, S=t, eps="fp32")
        # a model's projections: aligned tensors, sizes and strides multiples of 16
        aligned = ("X", "R", "NW", "W", "Y", "S", "N", "K", "stride_x", "stride_r", "stride_w", "stride_y")
        for rows in (1, 2, 4):
            for n in (896, 4096):
                block_m, block_n, block_k, warps = tg.gemv_config(rows, n)
                for prologue, res in ((tg.NONE, False), (tg.NORM, False), (tg.NORM, True), (tg.SILU_MUL, False)):
                    consts = dict(PROLOGUE=prologue, HAS_RES=res, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
                    out = compile_for_cuda(tg._gemv_kernel, arch, ptrs, consts, aligned, num_warps=warps)
                    ptx = out.asm["ptx"]
                    assert "ld.local" not in ptx, f"register spills at {consts}"
                    # the weight streams in 16-byte loads (8 bf16 / fp16 a thread a load)
                    assert "ld.global.v4.b32" in ptx, f"no vector loads at {consts}"

    report_runs(runs, compile_all)


kernel_run_tests(globals(), "test_triton_gemv", RUNS, COMPILE_RUNS, on_cuda=lambda run: run_case(run, "cuda"))
