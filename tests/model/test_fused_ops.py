"""The fused CUDA kernels of :mod:`llmkit.core.model.triton_pointwise` (residual add + RMSNorm,
SiLU-and-mul, rotary) against the torch forms they replace.

On CPU they run in Triton's interpreter, in fresh subprocesses (``TRITON_INTERPRET=1`` must be set
before triton is imported), and are compiled for sm_80 / sm_90 with Triton's bundled ptxas; on a
CUDA device the same cases run compiled (marked ``gpu``). Shapes include widths that are not
powers of two, strided inputs (a fused QKV projection's views), several head blocks and zero rows.

Reference: the op in fp64 on the same inputs. Bounds: fp32 1e-5 relative to the output's largest
value; fp16 / bf16 one rounding of the output (2^-10 / 2^-7 of it), plus the residual sum's rounding
the unfused form shares. A whole tiny model's logits with the kernels equal the torch forms' within
fp32 noise. A row's result does not depend on the other rows of the call.
"""

from __future__ import annotations

import torch

from attention_utils import assert_close_to_largest, compile_for_cuda, kernel_run_tests, report_runs

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = ("float32", "float16", "bfloat16")
RUNS = [f"{op}:{dt}" for op in ("norm", "norm_residual", "silu_mul", "rotate") for dt in DTYPES]
RUNS += ["rows_do_not_depend_on_the_batch", "tiny_model_logits"]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert_close_to_largest(got, want, dtype, what, TOL)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check_norm(dtype: torch.dtype, device: str, residual: bool) -> None:
    from llmkit.core.model import triton_pointwise as tp

    for rows, n in ((5, 896), (3, 100), (1, 4096), (0, 64)):
        x = torch.randn(rows, n, generator=_gen(1)).to(device, dtype)
        r = torch.randn(rows, n, generator=_gen(2)).to(device, dtype) if residual else None
        w = (1 + 0.1 * torch.randn(n, generator=_gen(3))).to(device, dtype)
        got = tp.rms_norm(x, w, 1e-6, r)
        s = x if r is None else (x + r)  # the sum, rounded to dtype as the unfused form rounds it
        sd = s.double()
        want = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
        if residual:
            got, total = got
            if dtype == torch.bfloat16 and device == "cpu":  # the interpreter's bf16 cast truncates
                torch.testing.assert_close(total, s, rtol=2**-7, atol=0)
            else:
                assert torch.equal(total, s), "the residual sum is the unfused x + residual"
        _close(got, want, dtype, f"norm {rows}x{n}")


def check_silu_mul(dtype: torch.dtype, device: str) -> None:
    from llmkit.core.model import triton_pointwise as tp

    for rows, inter in ((4, 4864), (3, 100), (0, 64)):
        gu = torch.randn(rows, 2 * inter, generator=_gen(4)).to(device, dtype)
        g, u = gu.double().split(inter, -1)
        _close(tp.silu_mul(gu, inter), torch.nn.functional.silu(g) * u, dtype, f"silu_mul {rows}x{inter}")


def check_rotate(dtype: torch.dtype, device: str) -> None:
    from llmkit.core.model import triton_pointwise as tp
    from llmkit.core.model.layers import RotaryEmbedding

    for t, h, d in ((7, 16, 64), (3, 40, 128), (2, 3, 40), (0, 2, 64)):
        rope = RotaryEmbedding(d, 64, {"rope_theta": 10000.0}).to(device)
        pos = torch.arange(5, 5 + t, device=device)
        cos2, sin2 = rope.table(pos, dtype)
        # a strided view, as the fused QKV projection's Q and K heads are
        qkv = torch.randn(t, (h + 2) * d, generator=_gen(5)).to(device, dtype)
        x = qkv[:, : h * d].view(t, h, d)
        xd, c, s = x.double(), cos2.double(), sin2.double()
        want = xd * c + xd.roll(d // 2, -1) * s
        _close(tp.rotate(x, cos2, sin2), want, dtype, f"rotate {t}x{h}x{d}")


def check_rows_do_not_depend_on_the_batch(device: str) -> None:
    from llmkit.core.model import triton_pointwise as tp

    x = torch.randn(9, 300, generator=_gen(6)).to(device, torch.bfloat16)
    r = torch.randn(9, 300, generator=_gen(7)).to(device, torch.bfloat16)
    w = torch.randn(300, generator=_gen(8)).to(device, torch.bfloat16)
    full = tp.rms_norm(x, w, 1e-5, r)[0]
    gu = torch.randn(9, 600, generator=_gen(9)).to(device, torch.bfloat16)
    fsm = tp.silu_mul(gu, 300)
    for lo, hi in ((0, 1), (4, 7), (8, 9)):
        assert torch.equal(tp.rms_norm(x[lo:hi], w, 1e-5, r[lo:hi])[0], full[lo:hi])
        assert torch.equal(tp.silu_mul(gu[lo:hi], 300), fsm[lo:hi])


def check_tiny_model_logits(device: str) -> None:
    """A tiny Qwen2 (QKV bias, tied embeddings) with every norm, SiLU-and-mul and rotation on the
    fused kernels equals its torch forms' logits (fp32: the C kernels and torch both stay off)."""
    import tempfile
    from pathlib import Path

    from llmkit.core.model import layers, triton_pointwise
    from llmkit.core.model.cpu import cpu_norm, cpu_pointwise
    from llmkit.plugins.attention import cpu_attention

    from model_utils import load_ours, save_tiny_model
    from tests.model.test_reference_transformers import _prefill_logits

    with tempfile.TemporaryDirectory() as d:
        save_tiny_model("qwen2", Path(d))
        model = load_ours(Path(d)).to(device)
    ids = list(range(3, 40))
    on_device = torch.device(device)
    # the torch forms: C kernels off (they would serve fp32 on the CPU, and the C attention would
    # rotate Q and K itself)
    cpu_norm.usable = lambda x, w: False
    cpu_pointwise._usable = lambda x: False
    cpu_attention.available = lambda *args, **kwargs: False
    want = _prefill_logits(model, ids, on_device)
    calls = {"rms_norm": 0, "silu_mul": 0, "rotate": 0}

    def counted(name):
        fn = getattr(triton_pointwise, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    fused = type("Fused", (), {name: staticmethod(counted(name)) for name in calls})
    layers._fused = lambda x: fused  # the interpreter stands in for CUDA
    got = _prefill_logits(model, ids, on_device)
    layers_n = len(model.layers)
    assert calls == {"rms_norm": 2 * layers_n + 1, "silu_mul": layers_n, "rotate": layers_n}, calls
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, err


def run_case(run: str, device: str) -> None:
    if ":" in run:
        op, dt = run.split(":")
        dtype = getattr(torch, dt)
        if op.startswith("norm"):
            return check_norm(dtype, device, residual=op == "norm_residual")
        return globals()[f"check_{op}"](dtype, device)
    globals()[f"check_{run}"](device)


def _main(runs: list[str]) -> None:
    from llmkit.core.model import triton_pointwise

    assert type(triton_pointwise._rms_norm_kernel).__name__ == "InterpretedFunction"
    report_runs(runs, lambda run: run_case(run, "cpu"))


COMPILE_RUNS = [f"{dt}:{arch}" for dt in DTYPES for arch in ("80", "90")]


def _compile_main(runs: list[str]) -> None:
    from llmkit.core.model import triton_pointwise as tp

    def compile_all(run: str) -> None:
        dtype, arch = run.split(":")
        t = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16"}[dtype]
        for block in (128, 1024, 8192):
            for res in (False, True):
                ptrs = dict(X=t, R=t, W=t, Y=t, S=t, eps="fp32")
                out = compile_for_cuda(
                    tp._rms_norm_kernel, arch, ptrs, dict(HAS_RES=res, BLOCK=block), num_warps=tp._warps(block)
                )
                assert "ld.local" not in out.asm["ptx"], f"register spills in rms_norm at {block}"
        compile_for_cuda(tp._silu_mul_kernel, arch, dict(GU=t, Y=t), dict(BLOCK=1024), num_warps=4)
        for block_h, block in ((32, 64), (16, 128)):
            consts = dict(BLOCK_H=block_h, BLOCK=block)
            compile_for_cuda(tp._rotate_kernel, arch, dict(X=t, C=t, S=t, Y=t), consts, num_warps=4)

    report_runs(runs, compile_all)


kernel_run_tests(globals(), "test_fused_ops", RUNS, COMPILE_RUNS, on_cuda=lambda run: run_case(run, "cuda"))
