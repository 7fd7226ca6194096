"""The Gated DeltaNet decode step for CUDA (``core/model/hybrid/triton_gated_delta.py``: the
convolution and the recurrent rule, states slot to slot) against the torch forms, in Triton's
interpreter in fresh subprocesses, and compiled for sm_80 / sm_90 without a GPU; on a CUDA device
the same cases run compiled (marked ``gpu``). Cases: fp32 and bf16 convolution states, fresh rows
(no state yet) among the others, 2 key heads serving 4 value heads, a value width that is not a
multiple of the column block."""

from __future__ import annotations

import torch

from attention_utils import compile_for_cuda, kernel_run_tests, report_runs

RUNS = ["decode_step:float32", "decode_step:bfloat16", "decode_step_wide_heads:float32"]
COMPILE_RUNS = ["sm80", "sm90"]


def check_decode_step(device: str, conv_dtype: torch.dtype, dk: int = 32, dv: int = 48) -> None:
    from llmkit.core.model.hybrid import causal_conv, gated_delta_rule
    from llmkit.core.model.hybrid import triton_gated_delta as tgd

    gen = torch.Generator().manual_seed(0)
    B, Hk, Hv, K = 5, 2, 4, 4
    C = 2 * Hk * dk + Hv * dv
    conv = torch.randn(2 * B, C, K - 1, generator=gen).to(conv_dtype)
    rec = 0.1 * torch.randn(2 * B, Hv, dk, dv, generator=gen)
    mixed, w = torch.randn(B, C, generator=gen), torch.randn(C, K, generator=gen)
    g, beta = -torch.rand(B, Hv, generator=gen), torch.rand(B, Hv, generator=gen)
    read, write = torch.arange(B) * 2, torch.arange(B) * 2 + 1
    fresh = torch.tensor([0, 1, 0, 0, 1], dtype=torch.uint8)
    keep = (fresh == 0).view(-1, 1, 1)
    conv_out, conv_new = causal_conv.conv_step(mixed, w, torch.where(keep, conv[read].float(), 0.0))
    q, k, v = conv_out.split([Hk * dk, Hk * dk, Hv * dv], dim=1)
    out, rec_new = gated_delta_rule.recurrent(
        q.reshape(B, Hk, dk),
        k.reshape(B, Hk, dk),
        v.reshape(B, Hv, dv),
        g,
        beta,
        torch.where(keep.view(-1, 1, 1, 1), rec[read], 0.0),
    )
    dev = lambda t: t.to(device)  # noqa: E731
    conv_d, rec_d = dev(conv), dev(rec)
    got_conv = tgd.conv_step(dev(mixed), dev(w), conv_d, dev(read), dev(write), dev(fresh))
    got = tgd.gated_delta_step(
        got_conv, Hk * dk, dev(g), dev(beta), rec_d, dev(read), dev(write), dev(fresh), Hk, Hv, dk, dv
    )
    torch.testing.assert_close(got_conv.cpu(), conv_out, atol=1e-5, rtol=1e-5)
    # (exact but for bf16 in the interpreter, whose cast truncates where torch rounds: one ulp)
    ulp = 2**-7 if conv_dtype == torch.bfloat16 and device == "cpu" else 0
    torch.testing.assert_close(conv_d[write].cpu(), conv_new.to(conv_dtype), atol=0, rtol=ulp)
    torch.testing.assert_close(got.cpu(), out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rec_d[write].cpu(), rec_new, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rec_d[read].cpu(), rec[read])  # the read slots stay as they were


def run_case(run: str, device: str) -> None:
    name, dtype = run.split(":")
    if name == "decode_step_wide_heads":
        check_decode_step(device, getattr(torch, dtype), dk=128, dv=128)
    else:
        check_decode_step(device, getattr(torch, dtype))


def _main(runs: list[str]) -> None:
    report_runs(runs, lambda run: run_case(run, "cpu"))


def _compile_main(runs: list[str]) -> None:
    from llmkit.core.model.hybrid import triton_gated_delta as tgd

    def compile_all(run: str) -> None:
        arch = run.removeprefix("sm")
        ptrs = dict(X="*fp32", W="*fp32", S="*fp32", READ="*i64", WRITE="*i64", FRESH="*u8", OUT="*fp32")
        compile_for_cuda(tgd._conv_step_kernel, arch, ptrs, dict(K=4, BLOCK=256), num_warps=4)
        ptrs = dict(
            QKV="*bf16", G="*fp32", BETA="*fp32", S="*fp32", READ="*i64", WRITE="*i64", FRESH="*u8", OUT="*fp32"
        )
        consts = dict(DK=128, DV=128, BLOCK_V=32)
        compile_for_cuda(tgd._gated_delta_step_kernel, arch, {**ptrs, "scale": "fp32"}, consts, num_warps=4)

    report_runs(runs, compile_all)


kernel_run_tests(globals(), "test_hybrid_triton", RUNS, COMPILE_RUNS, on_cuda=lambda run: run_case(run, "cuda"))
