"""CUDA's int4 path: the Triton w4a16 kernel (:mod:`llmkit.core.model.quant.int4_triton`) and
:class:`Int4Format` on it, against torch.

On CPU the kernel runs in Triton's interpreter, in fresh subprocesses with ``TRITON_INTERPRET=1``
set before anything imports triton (as test_fused_moe_triton does), on small shapes: 1, 16 and 130
rows, N = 200 (not a multiple of the column tile), groups 32 and 128, fp32 / fp16 / bf16
activations, K split over programs, a partial last K step, scale-only and bf16-scale layouts. The
format-level cases make the interpreter stand in for CUDA (``TRITON_DEVICES`` gains "cpu"): packing
at finalize, dense_weight / embed, tensor-parallel slices, and GPTQ (act order) / AWQ checkpoints
end to end. The kernel is also compiled for sm_80 / sm_90 with Triton's bundled ptxas, and on a
CUDA device the cases run compiled.

Reference: ``x.float() @ W^T`` in fp32 with ``W`` dequantized from the *stored* scales and zeros
(fp16 or bf16, :func:`int4_triton.pack`), so the tolerances cover the kernel alone:
- fp32 activations (``ieee`` dot under the interpreter): 1e-5 of the output's largest value.
- fp16: each weight rounded to fp16 before the dot (2^-11 relative) and the output rounded to fp16:
  2e-3 of the output's largest value (measured 3-4e-4).
- bf16: the same with 2^-8: 1.5e-2 (measured 3-5e-3).
Compiled on a GPU, fp32 activations multiply in full fp32 too (``ieee``, not tf32): the same bound.
A deterministic call's rows do not depend on the call's row count; under the interpreter the kernel
sums its products itself there, since numpy's matmul (the interpreter's tl.dot) rounds a row by
its position in the tile.
A layout mistake (nibble order, transposition, group offset) gives errors of order 100%.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from llmkit.core.model import quantize

from attention_utils import compile_for_cuda, kernel_run_tests, report_runs

N, K = 200, 384
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}

# kernel cases: "kernel:group:dtype:m"
KERNEL_RUNS = [f"kernel:{g}:{dt}:{m}" for g in (32, 128) for dt in ("float16", "bfloat16") for m in (1, 16, 130)]
KERNEL_RUNS += ["kernel:32:float32:16", "kernel:128:float32:130"]
OTHER_RUNS = [
    "split_k",  # K split over 3 and 5 programs (one split with no K steps): fp32 partial sums
    "partial_k_step",  # K = 352 with 64-wide K steps and a partial last group
    "scale_only",  # every zero 0: no zeros stored or read
    "bf16_scales",  # scales below fp16's normal range: stored in bf16
    "rows_do_not_depend_on_m",
    "format",
    "tensor_parallel",
    "gptq",
    "gptq_act_order",
    "awq",
]
RUNS = KERNEL_RUNS + OTHER_RUNS


def _weights(n: int, k: int, group: int, device="cpu", seed: int = 0):
    """Random ``q, scale, zero`` (``w = (q - 8) * scale + zero``) and the kernel's packing of them."""
    from llmkit.core.model.quant import int4_triton
    from llmkit.core.model.quant.int4_format import quantize_int4

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, :group] += 0.2  # a shifted group: nonzero zeros
    q, scale, zero = (t.to(device) for t in quantize_int4(w, group))
    return q, scale, zero, int4_triton.pack(q, scale, zero)


def _dequantized(words, sz, group: int) -> torch.Tensor:
    """The fp32 weight the packed buffers hold (their stored, rounded scales and zeros)."""
    from llmkit.core.model.quant import int4_triton

    q, scale, zero = int4_triton.unpack(words, sz)
    n, k = q.shape
    g = scale.shape[1]
    qs = torch.nn.functional.pad(q.float(), (0, g * group - k)).view(n, g, group)
    return ((qs - 8) * scale[..., None] + zero[..., None]).view(n, -1)[:, :k]


def _check_close(got, x, w, what: str, tol: dict) -> None:
    want = x.float() @ w.t()
    assert got.shape == want.shape and got.dtype == x.dtype, (got.shape, got.dtype)
    scale = want.abs().max().item()
    err = (got.float() - want).abs().max().item()
    assert scale > 0.1, "a degenerate case: the reference output is ~0"
    assert err <= tol[x.dtype] * scale, f"{what}: max abs error {err:.3g} (output scale {scale:.3g})"


def check_kernel(group: int, dtype: torch.dtype, m: int, device: str, tol=TOL) -> None:
    from llmkit.core.model.quant.int4_triton import w4a16_linear

    q, scale, zero, (words, sz) = _weights(N, K, group, device)
    assert words.shape == (K // 8, N) and words.dtype == torch.int32 and sz.shape == (2, K // group, N)
    assert sz.dtype == torch.float16
    w = _dequantized(words, sz, group)
    # the packing is lossless in q and rounds scales/zeros to fp16 only
    ref = ((q.float().view(N, -1, group) - 8) * scale[..., None] + zero[..., None]).view(N, K)
    torch.testing.assert_close(w, ref, rtol=0, atol=2**-10 * ref.abs().max().item())
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(device, dtype)
    _check_close(w4a16_linear(x, words, sz, group), x, w, f"g{group} {dtype} m={m}", tol)
    if m > 1:  # strided activations (a view of a wider tensor)
        wide = torch.randn(m, K + 64, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        xs = wide[:, 32 : 32 + K]
        _check_close(w4a16_linear(xs, words, sz, group), xs, w, "strided rows", tol)


def check_split_k(device: str) -> None:
    from llmkit.core.model.quant.int4_triton import config, w4a16_linear

    _, _, _, (words, sz) = _weights(N, K, 32, device)
    w = _dequantized(words, sz, 32)
    x = torch.randn(5, K).to(device, torch.float16)
    bm, bn, bk, warps, stages, _ = config(5, N, K, 32, torch.device(device))
    for split in (3, 5):  # 12 K steps: 4 per split; 3 per split and the fifth split has none
        got = w4a16_linear(x, words, sz, 32, cfg=(bm, bn, bk, warps, stages, split))
        _check_close(got, x, w, f"split {split}", TOL)


def check_partial_k_step(device: str) -> None:
    """K = 352 = 2.75 groups of 128, multiplied in 64-wide K steps: the last step is half masked."""
    from llmkit.core.model.quant import int4_triton
    from llmkit.core.model.quant.int4_triton import w4a16_linear

    k, group = 352, 128
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (N, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(N, 3, generator=g) * 0.01 + 0.001
    zero = torch.randn(N, 3, generator=g) * 0.01
    words, sz = int4_triton.pack(q.to(device), scale.to(device), zero.to(device))
    w = _dequantized(words, sz, group)
    x = torch.randn(20, k, generator=g).to(device, torch.float16)
    got = w4a16_linear(x, words, sz, group, cfg=(16, 32, 64, 4, 1, 1))
    _check_close(got, x, w, "partial K step", TOL)


def check_scale_only(device: str) -> None:
    from llmkit.core.model.quant import int4_triton
    from llmkit.core.model.quant.int4_triton import w4a16_linear

    g = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8).to(device)
    scale = (torch.rand(N, K // 32, generator=g) * 0.01 + 0.001).half().float().to(device)  # Q4_0's fp16 d
    words, sz = int4_triton.pack(q, scale, torch.zeros_like(scale))
    assert sz.shape == (1, K // 32, N) and sz.dtype == torch.float16
    assert torch.equal(sz[0].t().float(), scale)  # kept exactly
    w = _dequantized(words, sz, 32)
    torch.testing.assert_close(w, (q.float() - 8).view(N, -1, 32).mul(scale[..., None]).view(N, K))
    x = torch.randn(16, K, generator=g).to(device, torch.bfloat16)
    _check_close(w4a16_linear(x, words, sz, 32), x, w, "scale only", TOL)


def check_bf16_scales(device: str) -> None:
    from llmkit.core.model.quant import int4_triton
    from llmkit.core.model.quant.int4_triton import w4a16_linear

    q, scale, zero, _ = _weights(N, K, 128, device)
    scale, zero = scale * 1e-4, zero * 1e-4  # scales ~1e-6: subnormal in fp16
    words, sz = int4_triton.pack(q, scale, zero)
    assert sz.dtype == torch.bfloat16
    w = _dequantized(words, sz, 128)
    ref = ((q.float().view(N, -1, 128) - 8) * scale[..., None] + zero[..., None]).view(N, K)
    torch.testing.assert_close(w, ref, rtol=0, atol=2**-7 * ref.abs().max().item())
    x = torch.randn(3, K).to(device, torch.float32)
    _check_close(w4a16_linear(x, words, sz, 128) * 1e4, x, w * 1e4, "bf16 scales", {torch.float32: 1e-4})


def check_rows_do_not_depend_on_m(device: str) -> None:
    """Deterministic mode: one tile configuration, K not split, so a row's result is the same
    whatever other rows share the call."""
    from llmkit.core.model.quant.int4_triton import w4a16_linear

    _, _, _, (words, sz) = _weights(N, K, 32, device)
    for dtype in (torch.float16, torch.float32):
        x = torch.randn(130, K, generator=torch.Generator().manual_seed(5)).to(device, dtype)
        full = w4a16_linear(x, words, sz, 32, deterministic=True)
        for lo, hi in ((0, 1), (37, 38), (129, 130), (3, 19), (100, 130)):
            part = w4a16_linear(x[lo:hi], words, sz, 32, deterministic=True)
            assert torch.equal(part, full[lo:hi]), f"{dtype} rows {lo}:{hi}"


def check_format(device: str) -> None:
    """A dense layer converted to Int4Format runs the Triton kernel with nothing dense resident."""
    from llmkit.core.model.linear import Linear
    from llmkit.core.model.quant.int4_format import Int4Format

    g = torch.Generator().manual_seed(6)
    w = torch.randn(N, K, generator=g) * 0.05
    with torch.device(device):
        layer = Linear(K, N)
    layer.load(w)
    layer.set_format(Int4Format(32))
    assert layer.q4_triton and not layer.q4_native and layer.weight is None
    assert layer._q4 is None and layer._q4_scale is None and layer._q4_zero is None  # staging freed
    assert layer.q4_packed.shape == (K // 8, N) and layer.q4_packed.device.type == torch.device(device).type
    assert {n for n, _ in layer.named_buffers()} == {"q4_packed", "q4_scale_zero"}
    deq = layer.format.dense_weight(layer)
    assert deq.shape == (N, K) and deq.dtype == torch.float32
    step = (w.view(N, -1, 32).amax(-1) - w.view(N, -1, 32).amin(-1)) / 15
    assert bool(((deq.cpu() - w).abs().view(N, -1, 32) <= step[..., None] * 0.51 + 2**-9).all())
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(7, K, generator=g).to(device, dtype)
        _check_close(layer(x), x, deq, f"format {dtype}", TOL)
        _check_close(layer(x, deterministic=True), x, deq, f"format deterministic {dtype}", TOL)
    ids = torch.tensor([[0, 199], [57, 57]], device=device)
    assert torch.equal(layer.format.embed(layer, ids), deq[ids])


def check_tensor_parallel(device: str) -> None:
    """Column- and row-parallel shards of an int4 weight (two ranks, collectives done by hand)."""
    from llmkit.core.model.linear import Linear
    from llmkit.core.model.loader.int4_checkpoints import PackedInt4Tensor
    from llmkit.core.model.parallel import TPGroup

    import tests.model.quant.test_int4_checkpoints as ck

    n, k, group = 256, 512, 128
    gen = torch.Generator().manual_seed(7)
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(1, 16, (k // group, n), generator=gen)
    s = (torch.rand(k // group, n, generator=gen) * 0.004 + 0.002).half()
    src = PackedInt4Tensor("gptq", group, {**ck._pack_gptq(q, z, torch.arange(k) // group), "scales": s}, "w")
    full = src.dequantize()
    x = torch.randn(9, k, generator=gen).to(device, torch.float16)
    outs = {}
    for style in ("column", "row"):
        per_rank = []
        for rank in range(2):
            with torch.device(device):
                layer = Linear(k, n, parallel=style, tp=TPGroup(rank, 2))
            layer.load(src)
            assert layer.format.name == "int4" and layer.q4_triton and layer.weight is None
            rows, cols = (
                (slice(rank * 128, rank * 128 + 128), slice(None))
                if style == "column"
                else (
                    slice(None),
                    slice(rank * 256, rank * 256 + 256),
                )
            )
            # exact but for the zeros' fp16 rounding
            tol = dict(rtol=0, atol=2**-10 * full.abs().max().item())
            torch.testing.assert_close(layer.format.dense_weight(layer).cpu(), full[rows, cols], **tol)
            per_rank.append(layer.format.apply(layer, x[:, cols], False).float())
        outs[style] = (torch.cat(per_rank, dim=1) if style == "column" else per_rank[0] + per_rank[1]).half()
    for style, got in outs.items():
        _check_close(got, x, full.to(device), f"{style} parallel", {torch.float16: 4e-3})


def _prefill_logits(model, ids: list[int], device: torch.device) -> torch.Tensor:
    from tests.model.test_reference_transformers import _prefill_logits as prefill

    return prefill(model, ids, device)


def check_checkpoint(method: str, act_order: bool, device: str, dtype: torch.dtype) -> None:
    """A tiny GPTQ/AWQ checkpoint (test_int4_checkpoints' writer) loaded on ``device`` runs its
    int4 layers on the Triton kernel; its logits match the same weights loaded dense there.

    Bound: the int4 values and groups are exact and the scales fp16 (GPTQ/AWQ's own), the zeros
    fp16-rounded (2^-12 relative); the rest is the dtype's rounding in the kernel vs the dense GEMM:
    0.5% relative in fp32 (measured 1.5e-4 under the interpreter, the zeros' rounding), 3% in bf16
    (not measured: no GPU here)."""
    from safetensors.torch import save_file

    from llmkit.core.engine.builder import build_model
    from llmkit.core.model.loader.int4_checkpoints import int4_checkpoint_weights
    from llmkit.core.model.loader.source import iter_safetensors, load_config
    from llmkit.core.plugins import registry

    import tests.model.quant.test_int4_checkpoints as ck

    dev = torch.device(device)
    with tempfile.TemporaryDirectory() as tmp:
        qdir, ddir = Path(tmp, "q"), Path(tmp, "dense")
        qdir.mkdir(), ddir.mkdir()
        ref = ck._write(method, qdir, act_order)
        save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(ddir / "model.safetensors"))
        cfg = load_config(qdir)
        cls = registry().model("LlamaForCausalLM")
        model = build_model(cls, cfg, dev, dtype)
        model.load_weights(int4_checkpoint_weights(iter_safetensors(qdir), cfg))
        quantize.finalize_weights(model)
        dense_cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
        dense = build_model(cls, dense_cfg, dev, dtype)
        dense.load_weights(iter_safetensors(ddir))
        quantize.finalize_weights(dense)
    for i, layer in enumerate(model.layers):
        for lin in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
            assert lin.format.name == "int4" and lin.q4_triton and lin.weight is None, lin
            assert lin.q4_packed.device.type == dev.type
    if act_order:
        perm = model.layers[0].self_attn.qkv_proj.in_perm
        assert perm is not None and perm.device.type == dev.type
    lin, ref_lin = model.layers[1].mlp.down_proj, dense.layers[1].mlp.down_proj
    x = torch.randn(5, lin.in_features, generator=torch.Generator().manual_seed(8)).to(dev, dtype)
    # fp32: the zeros' fp16 rounding (2^-12 relative) over 256 inputs, measured 1.5e-4
    _check_close(lin(x), x, ref_lin.weight.float(), "down_proj", {**TOL, torch.float32: 1e-3})
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    got, want = _prefill_logits(model, ids, dev), _prefill_logits(dense, ids, dev)
    rel = ((got - want).norm() / want.norm()).item()
    print(f"{method} act_order={act_order} {dtype}: logits within {rel:.2e} relative")
    assert rel < (0.005 if dtype == torch.float32 else 0.03), rel
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def run_case(run: str, device: str, tol=TOL) -> None:
    if run.startswith("kernel:"):
        _, group, dtype, m = run.split(":")
        return check_kernel(int(group), getattr(torch, dtype), int(m), device, tol)
    if run in ("gptq", "gptq_act_order", "awq"):
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        return check_checkpoint(run.split("_")[0], run == "gptq_act_order", device, dtype)
    globals()[f"check_{run}"](device)


def _main(runs: list[str]) -> None:
    """Subprocess entry: the runs under the interpreter, with it standing in for CUDA."""
    from llmkit.core.model.quant import int4_format, int4_triton

    assert int4_triton.is_interpreted()
    int4_format.TRITON_DEVICES = ("cuda", "cpu")
    report_runs(runs, lambda run: run_case(run, "cpu"))


def test_cpu_layers_keep_their_kernels():
    """Without the interpreter standing in, a CPU layer packs for the CPU kernels as before."""
    from llmkit.core.model.linear import Linear
    from llmkit.core.model.quant.int4_format import TRITON_DEVICES, Int4Format

    assert TRITON_DEVICES == ("cuda",)
    layer = Linear(256, 64)
    layer.load(torch.randn(64, 256) * 0.05)
    layer.set_format(Int4Format(32))
    assert not layer.q4_triton and layer.q4_packed.dtype == torch.uint8


COMPILE_RUNS = ["float16:90", "bfloat16:90", "bfloat16:80", "float32:90"]


def _compile_main(runs: list[str]) -> None:
    """Subprocess entry (no TRITON_INTERPRET): compile the kernel for ``dtype:arch`` in every
    configuration of the table, with and without zeros and a K split."""
    from llmkit.core.model.quant import int4_triton as it

    def compile_all(run: str) -> None:
        dtype_name, arch = run.split(":")
        t = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}[dtype_name]
        for _, (bm, bn, bk, warps, stages) in [*it._CONFIGS, (0, it._DETERMINISTIC)]:
            for group, has_zero, split in ((32, True, 1), (128, False, 4)):
                ptrs = dict(X=t, Y=t, W="*i32", S="*fp16", Z="*fp16", P="*fp32")
                consts = dict(GROUP=group, HAS_ZERO=has_zero, SPLIT_K=split, BLOCK_M=bm, BLOCK_N=bn)
                consts.update(BLOCK_K=min(bk, group), UPCAST=False, ROWWISE=False)
                consts.update(DOT_PREC="ieee" if dtype_name == "float32" else None)
                if dtype_name == "float32":
                    stages = min(stages, it._FP32_STAGES)
                out = compile_for_cuda(it._w4a16_kernel, arch, ptrs, consts, num_warps=warps, num_stages=stages)
                # ~100 KB at most (sm_86/89: 99 KB a block; sm_80: 163 KB; sm_90: 227 KB)
                assert out.metadata.shared <= (232448 if arch == "90" else 101376), (bm, bn, bk, stages)
                assert "ld.local" not in out.asm["ptx"], f"register spills at {bm}x{bn}x{bk}"

    report_runs(runs, compile_all)


kernel_run_tests(globals(), "test_int4_triton", RUNS, COMPILE_RUNS, on_cuda=lambda run: run_case(run, "cuda", TOL))


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 7, 16, 33, 64, 100, 1000])
def test_compiled_table_configs_match_torch(m: int) -> None:
    """Every row range of the configuration table, K split where it applies, on a larger layer."""
    from llmkit.core.model.quant.int4_triton import config, w4a16_linear

    _, _, _, (words, sz) = _weights(1000, 2048, 128, "cuda")
    w = _dequantized(words, sz, 128)
    assert config(1, 1000, 2048, 128, torch.device("cuda"))[-1] > 1  # decode splits K
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(m, 2048, device="cuda", dtype=dtype)
        _check_close(w4a16_linear(x, words, sz, 128), x, w, f"m={m} {dtype}", TOL)


@pytest.mark.gpu
@gpu
def test_int4_quantization_engine_on_cuda(tmp_path):
    """``--quantization int4`` on CUDA: every linear layer on the Triton kernel, none dense."""
    from llmkit.core.model.linear import Linear

    from model_utils import _greedy, start_engine, tiny_model_dir

    model = str(tiny_model_dir(tmp_path))  # no embedded-model package needed on the GPU machine
    engine = start_engine(
        model_path=model, device="cuda", quantization="int4", quantization_group_size=64, max_total_tokens=512
    )
    try:
        lins = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
        assert lins and all(m.format.name == "int4" and m.q4_triton and m.weight is None for m in lins)
        assert all(m.q4_packed.is_cuda for m in lins)
        toks, _ = _greedy(engine, "a", [1, 200, 300, 400], 8)
        assert len(toks) == 8
    finally:
        engine.shutdown()
