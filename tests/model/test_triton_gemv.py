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

import os

import torch

from attention_utils import assert_close_to_largest, compile_for_cuda, kernel_run_tests, report_runs

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = ("float32", "float16", "bfloat16")
OPS = ("plain", "norm", "norm_residual", "silu_mul", "rope_store")
RUNS = [f"{op}:{dt}" for op in OPS for dt in DTYPES]
RUNS += ["rows_do_not_depend_on_the_batch", "tiny_model_logits", "tiny_model_logits_triton_attention"]
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

    if op == "rope_store":
        return check_rope_store(dtype, device)
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


# (rows, query heads, KV heads, head size, K, bias): the 8-column blocks; 16-column blocks (N >= 4096)
ROPE_SHAPES = ((1, 4, 2, 16, 48, True), (3, 14, 2, 64, 40, False), (4, 2, 1, 16, 24, True))
ROPE_WIDE = (2, 32, 8, 128, 16, True)


def check_rope_store(dtype: torch.dtype, device: str) -> None:
    """The QKV product with the rotate-and-store epilogue equals the product followed by
    ``rope_store_kv``: the same rotated queries, the same K/V in the pool (other slots untouched)."""
    from llmkit.core.model import triton_gemv
    from llmkit.core.model.layers import RotaryEmbedding
    from llmkit.plugins.attention.triton_rope_store import rope_store_kv

    for rows, heads, kv_heads, d, k, has_bias in ROPE_SHAPES + ((ROPE_WIDE,) if dtype == torch.float32 else ()):
        n = (heads + 2 * kv_heads) * d
        x, w = _inputs(rows, n, k, dtype, device)
        nw = (1 + 0.1 * torch.randn(k, generator=_gen(3))).to(device, dtype)
        r = torch.randn(rows, k, generator=_gen(4)).to(device, dtype)
        bias = torch.randn(n, generator=_gen(5)).to(device, dtype) if has_bias else None
        rope = RotaryEmbedding(d, 64, {"rope_theta": 10000.0}).to(device)
        cos2, sin2 = rope.table(torch.tensor([5, 0, 63, 17][:rows], device=device), dtype)
        slots = torch.tensor([7, 2, 9, 4][:rows], device=device)
        pools = [torch.randn(12, kv_heads, d, generator=_gen(6)).to(device, dtype) for _ in range(4)]
        k_want, v_want, k_got, v_got = (p.clone() for p in pools)
        qkv, s_want = triton_gemv.gemv(x, w, norm=(nw, 1e-6), residual=r)
        q_want = rope_store_kv(qkv, cos2, sin2, heads, k_want, v_want, slots, bias)
        store = triton_gemv.RopeStore(cos2, sin2, heads, k_got, v_got, slots, bias)
        q_got, s_got = triton_gemv.gemv(x, w, norm=(nw, 1e-6), residual=r, rope=store)
        what = f"rope_store {rows} rows, {heads}/{kv_heads} heads of {d}, K {k}"
        # compiled, the two kernels may contract the rotation into different FMAs
        tol = dict(rtol=0, atol=0) if device == "cpu" else dict(rtol=torch.finfo(dtype).eps, atol=1e-6)
        for got, want, name in ((q_got, q_want, "q"), (k_got, k_want, "k"), (v_got, v_want, "v"), (s_got, s_want, "s")):
            torch.testing.assert_close(got, want, **tol, msg=lambda m, name=name: f"{what}: {name}: {m}")


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


def check_tiny_model_logits_triton_attention(device: str) -> None:
    if device == "cpu":  # (this subprocess imported triton in its interpreter already)
        os.environ["LLMKIT_TRITON_INTERPRET"] = "1"
    check_tiny_model_logits(device, triton_attention=True)


def check_tiny_model_logits(device: str, triton_attention: bool = False) -> None:
    """A tiny Qwen2 (QKV bias, tied embeddings) run on three tokens, every block on the fused
    GEMVs, equals its torch forms' logits (fp32: the C kernels stay off). With the Triton attention
    backend the QKV products rotate and write the K/V themselves (``kv_write_target``)."""
    import tempfile
    from pathlib import Path
    from types import SimpleNamespace

    from llmkit.core.model import gemv_choice, layers, triton_gemv, triton_pointwise
    from llmkit.core.model.cpu import cpu_norm, cpu_pointwise
    from llmkit.plugins.attention import cpu_attention
    from llmkit.plugins.attention.torch_backend import TorchAttentionBackend
    from llmkit.plugins.attention.triton_backend import TritonAttentionBackend

    from model_utils import load_ours, save_tiny_model
    from tests.model.test_reference_transformers import _prefill_logits

    with tempfile.TemporaryDirectory() as d:
        save_tiny_model("qwen2", Path(d))
        model = load_ours(Path(d)).to(device)
    with torch.no_grad():  # (transformers initialises biases to zero)
        for layer in model.layers:
            layer.self_attn.qkv_proj.bias.normal_(generator=_gen(7))
    ids = [3, 17, 40]
    on_device = torch.device(device)
    cpu_norm.usable = lambda x, w: False
    cpu_pointwise._usable = lambda x: False
    cpu_attention.available = lambda *args, **kwargs: False
    layers._fused = lambda x: triton_pointwise  # the interpreter stands in for CUDA
    backend = TritonAttentionBackend if triton_attention else TorchAttentionBackend
    want = _prefill_logits(model, ids, on_device, backend=backend)
    calls, ropes = [0], [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        ropes[0] += kwargs.get("rope") is not None
        return triton_gemv.gemv(*args, **kwargs)

    # The measured choice, with a stand-in timer (CUDA graphs on a GPU) that favours the GEMVs: one
    # measurement for both layers (one shape), which runs each form once more.
    timed = []

    def timer(fn):
        timed.append(fn.func.__name__)
        fn()
        return 0.0 if fn.func.__name__ == "_forward_gemv" else 1.0

    layers.GEMV_MEASURED, gemv_choice.timer = True, timer
    layers.decode_gemv = lambda x: SimpleNamespace(
        gemv=counted, RopeStore=triton_gemv.RopeStore, rope_fits=triton_gemv.rope_fits
    )
    got = _prefill_logits(model, ids, on_device, backend=backend)
    assert timed == ["_forward_gemv", "forward"], timed
    assert calls[0] == 4 * (len(model.layers) + 1), calls
    assert ropes[0] == (len(model.layers) + 1 if triton_attention else 0), ropes
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
        ptrs = dict(X=t, R=t, NW=t, W=t, Y=t, S=t, eps="fp32", Bias=t, C=t, Sn=t, K_buf=t, V_buf=t, slots="*i64")
        # a model's projections: aligned tensors, sizes and strides multiples of 16
        aligned = ("X", "R", "NW", "W", "Y", "S", "N", "K", "stride_x", "stride_r", "stride_w", "stride_y")
        # plain products of 896 and 4,096 columns; QKV products with the rotate-and-store epilogue of
        # Qwen2.5-0.5B (14 + 2 + 2 heads of 64) and Llama-3.1-8B (32 + 8 + 8 heads of 128)
        for rows in (1, 2, 4):
            for n, rope in ((896, None), (4096, None), (1152, (14, 2, 64)), (6144, (32, 8, 128))):
                block_m, block_n, block_k, warps = tg.gemv_config(rows, n)
                variants = ((tg.NONE, False), (tg.NORM, False), (tg.NORM, True), (tg.SILU_MUL, False))
                if rope is not None:  # (the first layer's norm without a residual: compiled above)
                    variants = ((tg.NORM, True),)
                for prologue, res in variants:
                    heads = dict(NUM_HEADS=0, NUM_KV_HEADS=0, PAIR=0)
                    if rope is not None:
                        heads = dict(NUM_HEADS=rope[0], NUM_KV_HEADS=rope[1], PAIR=rope[2] // 2)
                    for has_bias in (False, True) if rope is not None else (False,):
                        consts = dict(
                            PROLOGUE=prologue, HAS_RES=res, ROPE=rope is not None, HAS_BIAS=has_bias, **heads,
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                        )  # fmt: skip
                        out = compile_for_cuda(tg._gemv_kernel, arch, ptrs, consts, aligned, num_warps=warps)
                        ptx = out.asm["ptx"]
                        assert "ld.local" not in ptx, f"register spills at {consts}"
                        # the weight streams in 16-byte loads (8 bf16 / fp16 a thread a load)
                        assert "ld.global.v4.b32" in ptx, f"no vector loads at {consts}"

    report_runs(runs, compile_all)


kernel_run_tests(globals(), "test_triton_gemv", RUNS, COMPILE_RUNS, on_cuda=lambda run: run_case(run, "cuda"))
