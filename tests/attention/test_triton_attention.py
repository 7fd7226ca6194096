"""The triton attention backend against the torch reference backend.

On CPU every case runs under Triton's interpreter. Triton picks interpreter vs compiler from
``TRITON_INTERPRET`` when ``@triton.jit`` runs, i.e. when the kernel modules are first imported;
any other test in this pytest process may already have imported triton or our kernels without it.
So the interpreter checks run in fresh subprocesses (two, to use both cores) with the variables
set before anything is imported; each case reports back by name and becomes its own test here.
On a CUDA device the same cases run compiled, in this process, in fp16 and bf16 (marked ``gpu``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from attention_utils import backend_kwargs, build_batch, run_in_subprocesses

# name: batch spec. seqs = [(cached prefix, new tokens)]; heads = (H, Hkv); share as in build_batch.
CASES: dict[str, dict] = {
    # extend: ragged prefill, some with cached prefixes, one decode-like row in a mixed batch
    "extend_ps1_gqa4": dict(seqs=[(0, 19), (21, 5), (7, 1)], heads=(8, 2), page_size=1, head_dim=32),
    "extend_ps4_mha_shared": dict(
        seqs=[(12, 6), (14, 17), (9, 3)], heads=(2, 2), page_size=4, head_dim=32, share={1: (0, 12), 2: (0, 8)}
    ),
    "extend_ps16_gqa8_layer1": dict(seqs=[(13, 7), (0, 33)], heads=(8, 1), page_size=16, head_dim=16, layers=2),
    # decode: ragged contexts across page boundaries, shared prefixes, several split-K chunks
    "decode_ps1_gqa8_shared": dict(
        seqs=[(40, 1), (3, 1), (70, 1), (0, 1)],
        heads=(8, 1),
        page_size=1,
        head_dim=32,
        share={2: (0, 37)},
        deterministic=True,
    ),
    "decode_ps4_mha_d24": dict(seqs=[(15, 1), (32, 1), (4, 1)], heads=(2, 2), page_size=4, head_dim=24),
    "decode_ps16_gqa4_shared": dict(
        seqs=[(47, 1), (33, 1)], heads=(4, 1), page_size=16, head_dim=32, share={1: (0, 32)}, deterministic=True
    ),
    # wider heads, several query blocks per sequence, prefix shared across a page boundary
    "extend_ps16_gqa4_d64_shared": dict(
        seqs=[(40, 37), (35, 20), (0, 1)], heads=(8, 2), page_size=16, head_dim=64, share={1: (0, 32)}
    ),
    # Qwen2.5-0.5B's head layout: 14 query heads over 2 KV heads (a group of 7, not a power of 2)
    "extend_ps4_gqa7": dict(seqs=[(6, 11), (0, 3)], heads=(14, 2), page_size=4, head_dim=16),
    "decode_ps4_gqa7": dict(seqs=[(26, 1), (5, 1)], heads=(14, 2), page_size=4, head_dim=16),
    # gpt-oss: sliding windows shorter than the contexts, attention sinks, cached prefixes.
    # A window of 5 < BLOCK_N leaves later rows of a query block without any key in the first key
    # blocks (the NaN-free path); a window of 20 spans several key blocks and split-K chunks.
    "extend_ps1_window5_sinks": dict(
        seqs=[(0, 19), (21, 5), (7, 1)], heads=(8, 2), page_size=1, head_dim=32, window=5, sinks=True
    ),
    "extend_ps16_window20_sinks_shared": dict(
        seqs=[(40, 37), (35, 20), (0, 3)],
        heads=(4, 1),
        page_size=16,
        head_dim=32,
        share={1: (0, 32)},
        window=20,
        sinks=True,
    ),
    "extend_ps16_sinks_only": dict(seqs=[(13, 7), (0, 33)], heads=(4, 2), page_size=16, head_dim=16, sinks=True),
    "extend_ps1_window_only_gqa7": dict(seqs=[(6, 11), (0, 3)], heads=(14, 2), page_size=1, head_dim=16, window=4),
    "decode_ps1_window16_sinks": dict(
        seqs=[(40, 1), (3, 1), (70, 1), (0, 1)],
        heads=(8, 1),
        page_size=1,
        head_dim=32,
        share={2: (0, 37)},
        deterministic=True,
        window=16,
        sinks=True,
    ),
    "decode_ps16_window20_sinks_shared": dict(
        seqs=[(47, 1), (33, 1), (10, 1)],
        heads=(4, 1),
        page_size=16,
        head_dim=32,
        share={1: (0, 32)},
        window=20,
        sinks=True,
    ),
    "decode_ps4_sinks_only": dict(seqs=[(15, 1), (32, 1)], heads=(2, 2), page_size=4, head_dim=24, sinks=True),
    # DeepSeek's latent KV (MLA, absorbed): MQA over one cached latent per token (a kv_lora_rank
    # of 32 or 64 plus 8 rope channels here), the values its first kv_lora_rank channels
    "extend_ps1_latent": dict(seqs=[(0, 19), (21, 5), (7, 1)], heads=(8, 1), page_size=1, head_dim=40, latent=32),
    "extend_ps16_latent_shared": dict(
        seqs=[(40, 20), (35, 9)], heads=(4, 1), page_size=16, head_dim=72, latent=64, share={1: (0, 32)}
    ),
    "decode_ps1_latent": dict(
        seqs=[(40, 1), (3, 1), (70, 1)], heads=(16, 1), page_size=1, head_dim=40, latent=32, deterministic=True
    ),
    # a latent wider than 256 channels: the query heads split in blocks of 16 (DeepSeek-V3's 128)
    "decode_ps4_latent_wide_head_blocks": dict(
        seqs=[(20, 1), (9, 1)], heads=(32, 1), page_size=4, head_dim=288, latent=256
    ),
    "decode_ps16_latent_shared": dict(
        seqs=[(47, 1), (33, 1)], heads=(4, 1), page_size=16, head_dim=72, latent=64, share={1: (0, 32)}
    ),
    # V heads of another size than K's (K 24, V 16; K 16, V 40)
    "extend_ps4_kv_dims_window": dict(
        seqs=[(13, 7), (0, 21)], heads=(4, 2), page_size=4, head_dim=24, v_dim=16, window=9
    ),
    "decode_ps1_kv_dims_sinks": dict(
        seqs=[(30, 1), (5, 1)], heads=(4, 1), page_size=1, head_dim=16, v_dim=40, sinks=True
    ),
    "decode_ps4_window_only": dict(seqs=[(15, 1), (32, 1), (2, 1)], heads=(4, 2), page_size=4, head_dim=16, window=7),
    # split counts the backend picks here only when told (``splits``): one (no counter: its only
    # program merges), and three (not a power of two: masked splits in the merge; some empty)
    "decode_ps4_gqa4_sinks_one_split": dict(
        seqs=[(15, 1), (32, 1), (2, 1)], heads=(8, 2), page_size=4, head_dim=16, sinks=True, splits=1
    ),
    "decode_ps1_gqa7_three_splits": dict(
        seqs=[(40, 1), (3, 1)], heads=(14, 2), page_size=1, head_dim=16, deterministic=True, splits=3
    ),
}
# Real model shapes, compiled on a GPU only (too slow for the interpreter).
GPU_CASES: dict[str, dict] = {
    "gpu_extend_llama8b": dict(
        seqs=[(1000, 300), (0, 513), (64, 64), (1100, 1)],
        heads=(32, 8),
        page_size=16,
        head_dim=128,
        share={3: (0, 992)},
    ),
    "gpu_decode_llama8b": dict(
        seqs=[(2047, 1), (100, 1), (4000, 1), (0, 1)], heads=(32, 8), page_size=16, head_dim=128, share={2: (0, 2032)}
    ),
    "gpu_decode_qwen05b": dict(seqs=[(3000, 1), (17, 1)], heads=(14, 2), page_size=1, head_dim=64, deterministic=True),
}
# The interpreter runs every case in fp32, and a few in fp16 and in bf16 (bf16 also covers the
# kernels' upcast-before-tl.dot path that works around triton #11584).
INTERP_RUNS = [f"{name}:float32" for name in CASES] + [
    f"{name}:{dt}"
    for name in (
        "extend_ps4_mha_shared",
        "decode_ps1_gqa8_shared",
        "extend_ps16_window20_sinks_shared",
        "decode_ps16_window20_sinks_shared",
        "extend_ps16_latent_shared",
        "decode_ps16_latent_shared",
    )
    for dt in ("float16", "bfloat16")
]
# the CUDA-graph hooks' static-buffer path vs eager, plain and with each optional feature
GRAPH_CASES = {
    "decode_ps4_gqa4_graph": dict(seqs=[(9, 1), (30, 1), (16, 1)], heads=(4, 1), page_size=4, head_dim=32),
    "decode_ps4_window_sinks_graph": dict(
        seqs=[(9, 1), (30, 1), (16, 1)], heads=(4, 1), page_size=4, head_dim=32, window=8, sinks=True
    ),
    "decode_ps4_latent_graph": dict(seqs=[(9, 1), (30, 1)], heads=(8, 1), page_size=4, head_dim=40, latent=32),
}
GRAPH_RUNS = [f"{name}:float32" for name in GRAPH_CASES]
# forward_qkv (one kernel rotates Q and K and stores K/V, from the fused projection) against
# rotating first and calling forward, on the plain layouts it takes
QKV_CASES = {
    f"qkv_{name}": CASES[name]
    for name in ("extend_ps1_gqa4", "extend_ps4_gqa7", "decode_ps4_gqa7", "decode_ps16_gqa4_shared")
}
QKV_CASES["qkv_bias_extend_ps4_gqa7"] = {**CASES["extend_ps4_gqa7"], "bias": True}  # Qwen2's QKV bias, folded
QKV_CASES["qkv_bias_decode_ps4_gqa7"] = {**CASES["decode_ps4_gqa7"], "bias": True}
QKV_RUNS = [f"{name}:{dt}" for name in QKV_CASES for dt in ("float32", "bfloat16")]
TOL = {torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _build(spec: dict, device: str, dtype: torch.dtype, seed: int = 0):
    h, hkv = spec["heads"]
    return build_batch(
        spec["seqs"],
        num_heads=h,
        num_kv_heads=hkv,
        head_dim=spec["head_dim"],
        page_size=spec["page_size"],
        dtype=dtype,
        device=device,
        num_layers=spec.get("layers", 1),
        share=spec.get("share"),
        deterministic=spec.get("deterministic", False),
        seed=seed,
        latent=bool(spec.get("latent")),
        v_head_dim=spec.get("v_dim"),
    )


def _window_and_sinks(spec: dict, device: str) -> dict:
    """The forward() keyword arguments of a case: its window, and random per-head sinks (fp32,
    spread wide enough that some outweigh every key and some do not)."""
    kwargs = {}
    if spec.get("window"):
        kwargs["sliding_window"] = spec["window"]
    if spec.get("sinks"):
        g = torch.Generator().manual_seed(1)
        kwargs["sinks"] = (torch.randn(spec["heads"][0], generator=g) * 3).to(device)
    return kwargs


def _backends(batch, num_heads: int, splits: int = 4, v_head_dim: int | None = None):
    from llmkit.plugins.attention.torch_backend import TorchAttentionBackend
    from llmkit.plugins.attention.triton_backend import TritonAttentionBackend

    kwargs = backend_kwargs(batch, num_heads, v_head_dim)
    tri = TritonAttentionBackend(**kwargs)
    tri.max_kv_splits = splits
    return tri, TorchAttentionBackend(**kwargs)


def _strided_views(q, k, v):
    """q/k/v as the models pass them: views into one fused qkv projection output."""
    if v is None:  # latent KV: q and the latent as parts of one tensor
        qk = torch.cat([q.flatten(1), k.flatten(1)], dim=1)
        qp, kp = qk.split([q[0].numel(), k[0].numel()], dim=1)
        return qp.view(-1, *q.shape[1:]), kp.view(-1, *k.shape[1:]), None
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    parts = qkv.split([q[0].numel(), k[0].numel(), v[0].numel()], dim=1)
    return tuple(p.view(-1, *t.shape[1:]) for p, t in zip(parts, (q, k, v)))


def check_case(name: str, device: str, dtype: torch.dtype) -> None:
    """Run case ``name`` through both backends; raise AssertionError on a mismatch."""
    spec = CASES.get(name) or GPU_CASES[name]
    b = _build(spec, device, dtype)
    splits = spec.get("splits", 4 if name in CASES else 16)
    tri, ref = _backends(b, spec["heads"][0], splits, v_head_dim=spec.get("latent") or spec.get("v_dim"))
    layer = spec.get("layers", 1) - 1
    q, k, v = _strided_views(b.q, b.k, b.v)
    opts = _window_and_sinks(spec, device)
    md = tri.prepare_metadata(b.md)
    out = tri.forward(q, k, v, layer, md, **opts)
    plan = md.extra["triton"]
    if plan.decode:  # the kernel leaves its split counters zeroed: the next launch reuses them
        assert "splits" not in spec or plan.num_splits == spec["splits"], plan.num_splits
        assert not plan.counters.any(), f"split counters left at {plan.counters.unique().tolist()}"
        assert torch.equal(tri.forward(q, k, v, layer, md, **opts), out), "a second launch differs"
        b.md.extra.clear()  # a step later: the same buffer, no new zeros (a fill kernel a step)
        assert tri.prepare_metadata(b.md).extra["triton"].counters is plan.counters, "counters re-allocated"
    # The store kernel wrote the new K/V (checked before the reference writes them too).
    slots = b.md.out_slots
    assert torch.equal(b.pool.k_buffers[layer][slots], b.k), "K not stored"
    if b.v is not None:
        assert torch.equal(b.pool.v_buffers[layer][slots], b.v), "V not stored"
    else:
        assert not b.pool.v_buffers and out.shape[-1] == spec["latent"]
    b.md.extra.clear()
    want = ref.forward(b.q, b.k, b.v, layer, ref.prepare_metadata(b.md), **opts)
    err = (out.float() - want.float()).abs().max().item()
    assert err <= TOL[dtype], f"{name}: max abs error {err:.3g} > {TOL[dtype]}"


def check_rope_store(name: str, device: str, dtype: torch.dtype) -> None:
    """``forward_qkv`` (rotation and K/V store in one kernel) equals rotating, then ``forward``:
    bit for bit where both rotate with the same kernel (CUDA), within rounding on the CPU (the
    separate rotation is a C function there)."""
    from llmkit.core.model.layers import RotaryEmbedding

    spec = QKV_CASES.get(name) or GPU_QKV_CASES[name]
    outs, pools = [], []
    for fused in (False, True):
        b = _build(spec, device, dtype)
        tri, _ = _backends(b, spec["heads"][0], splits=4 if name in QKV_CASES else 16)
        rope = RotaryEmbedding(spec["head_dim"], 8192, {"rope_theta": 10000.0}).to(device)
        pos = [p for q_len, kv in zip(b.md.q_lens, b.md.kv_lens) for p in range(kv - q_len, kv)]
        table = rope.table(torch.tensor(pos, device=device), dtype)
        qkv = torch.cat([b.q.flatten(1), b.k.flatten(1), b.v.flatten(1)], dim=1)
        bias = None
        if spec.get("bias"):
            bias = torch.randn(qkv.shape[1], generator=torch.Generator().manual_seed(2)).to(device, dtype)
        md = tri.prepare_metadata(b.md)
        if fused:
            out = tri.forward_qkv(qkv, table, 0, md, **({} if bias is None else {"bias": bias}))
            assert out is not None, "forward_qkv not taken"
        else:
            if bias is not None:
                qkv = qkv + bias
            h, hkv, d = spec["heads"][0], spec["heads"][1], spec["head_dim"]
            q, k, v = (p.view(-1, n, d) for p, n in zip(qkv.split([h * d, hkv * d, hkv * d], dim=1), (h, hkv, hkv)))
            out = tri.forward(RotaryEmbedding.rotate(q, table), RotaryEmbedding.rotate(k, table), v, 0, md)
        slots = b.md.out_slots
        outs.append(out.float())
        pools.append(torch.cat([b.pool.k_buffers[0][slots].float(), b.pool.v_buffers[0][slots].float()]))
    exact = device != "cpu"
    for what, (a, w) in (("output", outs), ("stored K/V", pools)):
        err = (a - w).abs().max().item()
        bound = TOL[dtype] * max(1.0, w.abs().max().item())  # (bf16 rounding is relative)
        assert (err == 0) if exact else err <= bound, f"{name} {what}: max abs error {err:.3g}"


def check_graph_hooks(name: str, device: str, dtype: torch.dtype, capture: bool) -> None:
    """Decode through the capture/replay static buffers equals eager decode.

    With ``capture`` (CUDA) a real graph is captured at a padded batch size and replayed; without
    it, forward simply runs on the capture metadata after prepare_for_replay (same buffers).
    """
    spec = GRAPH_CASES[name]
    b = _build(spec, device, dtype)
    h = spec["heads"][0]
    tri, _ = _backends(b, h, v_head_dim=spec.get("latent"))
    opts = _window_and_sinks(spec, device)
    eager = tri.forward(b.q, b.k, b.v, 0, tri.prepare_metadata(b.md), **opts)
    n, bs = b.md.num_seqs, b.md.num_seqs + 2  # replay pads the batch, as bucketed graphs do
    tri.init_capture_graph(max_bs=8, max_context=b.req_pool.table.shape[1])
    cap_md = tri.prepare_for_capture(bs)
    sq = torch.zeros((bs, h, spec["head_dim"]), dtype=dtype, device=device)
    sk = torch.zeros((bs, spec["heads"][1], spec["head_dim"]), dtype=dtype, device=device)
    sv = None if b.v is None else torch.zeros_like(sk)
    if capture:
        tri.forward(sq, sk, sv, 0, cap_md, **opts)  # warm-up compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sout = tri.forward(sq, sk, sv, 0, cap_md, **opts)
    tri.prepare_for_replay(bs, b.md)
    sq[:n], sk[:n] = b.q, b.k
    if sv is not None:
        sv[:n] = b.v
    if capture:
        graph.replay()
        torch.cuda.synchronize()
    else:
        sout = tri.forward(sq, sk, sv, 0, cap_md, **opts)
    err = (sout[:n].float() - eager.float()).abs().max().item()
    assert err <= TOL[dtype] / 10, f"graph replay differs from eager by {err:.3g}"
    assert not cap_md.extra["triton"].counters.any(), "the graph's split counters are not zeroed"


def _main(runs: list[str]) -> None:
    """Subprocess entry: run ``name:dtype`` checks under the interpreter, print JSON results."""
    results = {}
    for run in runs:
        name, dtype = run.split(":")
        try:
            if name in GRAPH_CASES:
                check_graph_hooks(name, "cpu", getattr(torch, dtype), capture=False)
            elif name in QKV_CASES:
                check_rope_store(name, "cpu", getattr(torch, dtype))
            else:
                check_case(name, "cpu", getattr(torch, dtype))
            results[run] = "ok"
        except Exception as exc:  # reported to the parent test, which fails with this text
            results[run] = f"{type(exc).__name__}: {exc}"
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str]:
    runs = [*INTERP_RUNS, *GRAPH_RUNS, *QKV_RUNS]
    env = {**os.environ, "TRITON_INTERPRET": "1", "LLMKIT_TRITON_INTERPRET": "1"}
    return run_in_subprocesses("test_triton_attention", "_main", [runs[0::2], runs[1::2]], env)  # two cores


@pytest.mark.parametrize("run", [*INTERP_RUNS, *GRAPH_RUNS, *QKV_RUNS])
def test_interpreter_matches_torch(run: str, interpreter_results: dict[str, str]) -> None:
    assert interpreter_results[run] == "ok", interpreter_results[run]


# GPU code generation is checked even without a GPU: Triton compiles the kernels to cubin for an
# sm_80/sm_90 target with its bundled ptxas, using the launchers' block configurations.
# dtype:head_dim:arch[:v_head_dim]; 576:...:512 is DeepSeek's latent KV (MLA), values inside the keys
COMPILE_RUNS = ["float16:128:90", "bfloat16:128:90", "bfloat16:64:80", "float16:256:90", "bfloat16:576:90:512"]


# The split counter's atomic as Triton 3.x spells it in PTX for sem="acq_rel", scope="gpu".
ACQ_REL_ADD = "atom.global.gpu.acq_rel.add"


def _check_decode_ptx(ptx: str, splits: int) -> None:
    """The decode kernel's merge hand-off: with several splits, a barrier between the partials'
    stores and the acq_rel counter increment (which publishes them), and the partials read back
    past L1; with one, no atomic at all. No local memory (spills) in the PTX either way."""
    assert "ld.local" not in ptx, f"register spills with {splits} splits"
    if splits == 1:
        assert "atom." not in ptx, "one split needs no counter"
        return
    atom = ptx.find(ACQ_REL_ADD)
    assert atom >= 0, f"no {ACQ_REL_ADD} in the PTX"
    last_store = ptx.rfind("st.global", 0, atom)
    assert "bar.sync" in ptx[last_store:atom] or "barrier.sync" in ptx[last_store:atom], "no barrier before the atomic"
    assert "ld.global.cg" in ptx[atom:], "the merge's loads do not bypass L1"


def _compile_main(runs: list[str]) -> None:
    """Subprocess entry (no TRITON_INTERPRET): compile every kernel for ``dtype:head_dim:arch``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from llmkit.plugins.attention import triton_decode as td
    from llmkit.plugins.attention import triton_extend as te
    from llmkit.plugins.attention import triton_rope_store as trs

    def build(fn, ptrs: dict, consts: dict, arch: int, warps: int):
        sig = {
            a: "constexpr" if a in consts else ptrs.get(a, "fp32" if a == "qk_scale" else "i32") for a in fn.arg_names
        }
        src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
        return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps, num_stages=2))

    results = {}
    for run in runs:
        dtype_name, head_dim, arch, *latent = run.split(":")
        dtype, d, arch = getattr(torch, dtype_name), int(head_dim), int(arch)
        dv = int(latent[0]) if latent else d
        bd, bdv = triton.next_power_of_2(d), triton.next_power_of_2(dv)
        t = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}[dtype]
        idx = dict.fromkeys(["slots", "req_to_token", "req_pool_indices", "q_start_loc", "q_lens", "kv_lens"], "*i64")
        ptrs = {**idx, **dict.fromkeys(["Q", "O", "K", "V", "K_buf", "V_buf"], t), "Mid_O": "*fp32", "Mid_LSE": "*fp32"}
        ptrs.update(Sinks="*fp32", Counter="*i32")
        sinks = dict(HAS_SINKS=arch == 90)  # both variants of the sink code get compiled
        upcast, prec = te.dot_options(dtype)
        dots = dict(UPCAST=upcast, DOT_PREC=prec, HEAD_DIM=d, BLOCK_D=bd, HEAD_DV=dv, BLOCK_DV=bdv)
        try:
            store = dict(NUM_KV_HEADS=8, HEAD_DIM=d, BLOCK_H=8, BLOCK_D=bd, HAS_V=not latent, HEAD_DV=dv, BLOCK_DV=bdv)
            build(te._store_kv_kernel, ptrs, store, arch, 4)
            if not latent:
                ptrs_rope = {**ptrs, "QKV": t, "C": t, "S": t, "Q_out": t, "Bias": t}
                rope = dict(
                    NUM_HEADS=32, NUM_KV_HEADS=8, HALF=d // 2, BLOCK_H=2048 // (bd // 2), BLOCK_KH=8, BLOCK=bd // 2
                )
                for has_bias in (False, True):
                    build(trs._rope_store_kernel, ptrs_rope, dict(rope, HAS_BIAS=has_bias), arch, 4)
            bm, bn, warps = te.extend_config(bd, dtype, False)
            build(te._extend_kernel, ptrs, dict(GROUP=4, BLOCK_M=bm, BLOCK_N=bn, **dots, **sinks), arch, warps)
            bn, warps = td.decode_config(bd, dtype, False)
            group, hb = (128, 8) if latent else (8, 1)  # DeepSeek-V3: 128 query heads over the latent
            decode = dict(GROUP=group, HEAD_BLOCKS=hb, BLOCK_H=16, BLOCK_N=bn, **dots, **sinks)
            for splits in (8, 1):  # one split merges without the counter
                out = build(td._decode_split_kernel, ptrs, dict(decode, NUM_SPLITS=splits, BLOCK_S=splits), arch, warps)
                _check_decode_ptx(out.asm["ptx"], splits)
            results[run] = "ok"
        except Exception as exc:
            results[run] = f"{type(exc).__name__}: {exc}"[:3000]
    print("RESULTS " + json.dumps(results))


def _can_compile_for_cuda() -> str | None:
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as exc:
        return f"this triton cannot compile offline: {exc}"
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        return "triton's bundled ptxas is missing"
    return None


@pytest.fixture(scope="module")
def compile_results() -> dict[str, str]:
    reason = _can_compile_for_cuda()
    if reason:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LLMKIT_TRITON_INTERPRET")}
    return run_in_subprocesses("test_triton_attention", "_compile_main", [COMPILE_RUNS[0::2], COMPILE_RUNS[1::2]], env)


@pytest.mark.parametrize("run", COMPILE_RUNS)
def test_kernels_compile_for_cuda(run: str, compile_results: dict[str, str]) -> None:
    assert compile_results[run] == "ok", compile_results[run]


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", [*CASES, *GPU_CASES])
def test_compiled_matches_torch(name: str, dtype: torch.dtype) -> None:
    check_case(name, "cuda", dtype)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(GRAPH_CASES))
def test_cuda_graph_replay_equals_eager(name: str, dtype: torch.dtype) -> None:
    check_graph_hooks(name, "cuda", dtype, capture=True)


GPU_QKV_CASES = {
    "qkv_gpu_decode_llama8b": GPU_CASES["gpu_decode_llama8b"],
    "qkv_bias_gpu_decode_qwen05b": {**GPU_CASES["gpu_decode_qwen05b"], "bias": True},
}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", [*QKV_CASES, *GPU_QKV_CASES])
def test_compiled_rope_store_equals_rotate_then_store(name: str, dtype: torch.dtype) -> None:
    check_rope_store(name, "cuda", dtype)
