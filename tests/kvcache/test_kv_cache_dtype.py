"""``--kv-cache-dtype`` (issue 11): the KV pool kept in another dtype than the model's, converted
on write and on read. On CPU the model computes in fp32, so a bf16 pool halves the memory the pool
takes (the larger part of llmkit's resident memory) and holds twice the tokens in a memory budget.

Tolerance of the logit checks: storing K/V in a dtype with machine epsilon ``eps`` perturbs every
cached value by a relative ``eps / 2`` at most, so the logits move in proportion to ``eps``. On the
embedded model (logit std ~6) the largest change over a prefill and 16 decode steps measured
20 x eps for bf16 (0.078), 10 x eps for fp16 and 11 x eps for fp8_e4m3; the bound is 40 x eps
(0.16 for bf16: still well under the top-1 gaps that decide greedy tokens). A bug (bytes read back
in another dtype, a stale or missing write) moves logits by whole units, far beyond it.
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from llmkit.core.kvcache.kv_pool import KV_CACHE_DTYPES, KVCachePool, gather_kv, resolve_kv_cache_dtype, store_kv
from llmkit.core.model import quantize

from model_utils import load_ours, save_tiny_model, start_engine
from paged_runner import PagedRunner
from server_utils import start_server, stop_server
from tests.conftest import Server

CPU = torch.device("cpu")
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def logit_tol(dtype: torch.dtype) -> float:
    return 40 * torch.finfo(dtype).eps


# -- the pool ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, *FP8])
@pytest.mark.parametrize("v_dim", [None, 0], ids=["kv", "latent"])
def test_pool_buffers_have_the_dtype_and_its_size(dtype, v_dim):
    kw = dict(num_layers=3, num_pages=9, page_size=4, num_kv_heads=2, head_dim=8, device=CPU, v_head_dim=v_dim)
    pool, fp32 = KVCachePool(dtype=dtype, **kw), KVCachePool(dtype=torch.float32, **kw)
    bufs = pool.k_buffers + pool.v_buffers
    assert len(bufs) == (3 if v_dim == 0 else 6) and all(b.dtype == dtype for b in bufs)
    assert pool.dtype == dtype
    assert pool.bytes_per_token() * 4 == fp32.bytes_per_token() * dtype.itemsize
    assert all(not b[:4].float().any() for b in bufs)  # page 0 (padding) zeroed
    # write and read back through the backends' helpers: rounded to the pool's dtype, nothing else
    x = torch.randn(5, 2, 8) * 4
    slots = pool.page_slots([3, 5])[:5]
    store_kv(pool.k_buffers[1], slots, x)
    got = gather_kv(pool.k_buffers[1], slots, torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, x.to(dtype).float())


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_store_saturates_instead_of_overflowing(dtype):
    buf = torch.zeros(4, 1, 2, dtype=dtype)
    store_kv(buf, torch.tensor([1, 2]), torch.tensor([[[1e6, -1e6]], [[0.5, 3.0]]]))
    limit = torch.finfo(dtype).max
    assert gather_kv(buf, torch.tensor([1, 2]), torch.float32).flatten().tolist() == [limit, -limit, 0.5, 3.0]


def test_names_resolve_and_a_bad_one_lists_the_valid_ones():
    from dataclasses import fields

    from llmkit.core.engine.config import EngineConfig
    from llmkit.core.option import allowed, option_of

    opt = option_of(next(f for f in fields(EngineConfig) if f.name == "kv_cache_dtype"))
    assert set(allowed(opt)) == {"auto", *KV_CACHE_DTYPES}  # the pre-load check reads this table
    assert resolve_kv_cache_dtype("auto", torch.float32) == torch.float32
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("bf16", torch.float32) == resolve_kv_cache_dtype("bfloat16", torch.float32)
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="valid: auto, bfloat16, bf16, float16, fp16, fp8, fp8_e4m3, fp8_e5m2"):
        resolve_kv_cache_dtype("int8", torch.float32)


def test_backends_declare_the_pool_dtypes_they_can_read():
    from llmkit.plugins.attention.flashinfer_backend import FlashInferAttentionBackend
    from llmkit.plugins.attention.torch_backend import TorchAttentionBackend
    from llmkit.plugins.attention.triton_backend import TritonAttentionBackend

    for cls in (TorchAttentionBackend, TritonAttentionBackend, FlashInferAttentionBackend):
        assert cls.kv_cache_dtype_support(torch.bfloat16, CPU) is None
        assert cls.kv_cache_dtype_support(torch.float16, CPU) is None
    assert TorchAttentionBackend.kv_cache_dtype_support(torch.float8_e5m2, CPU) is None
    assert "compute capability 8.9" in TritonAttentionBackend.kv_cache_dtype_support(torch.float8_e4m3fn, CPU)
    assert "float8_e4m3fn" in FlashInferAttentionBackend.kv_cache_dtype_support(torch.float8_e4m3fn, CPU)


def test_pool_sized_from_memory_holds_twice_the_tokens_in_bf16(tiny_llama):
    from llmkit.core.engine.builder import build_engine_parts
    from llmkit.core.engine.config import EngineConfig

    pools = {}
    for name in ("auto", "bfloat16"):
        cfg = EngineConfig(
            model_path=str(tiny_llama),
            device="cpu",
            kv_cache_dtype=name,
            mem_fraction_static=0.002,
            grammar_backend="none",
        )  # tens of MB of RAM: pages are committed only when written
        pools[name] = build_engine_parts(cfg).scheduler.pool
    fp32, bf16 = pools["auto"], pools["bfloat16"]
    assert fp32.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert bf16.bytes_per_token() * 2 == fp32.bytes_per_token()
    # the same budget (RAM share minus the same weights) over half the bytes per token
    assert bf16.capacity_pages in (2 * fp32.capacity_pages, 2 * fp32.capacity_pages + 1)


# -- models ------------------------------------------------------------------------------------


def _greedy_logits(model, ids: list[int], kv_dtype, steps: int, forced: list[int] | None = None):
    """Logits of the prompt's last token and of ``steps`` decode steps through the paged path
    (page size 4); the tokens fed are the argmax of each step, or ``forced``."""
    runner = PagedRunner(model, 4, kv_dtype=kv_dtype)
    row = runner.new_seq()
    out, toks = [runner.step([(row, ids)])[0][-1]], []
    for i in range(steps):
        toks.append(int(out[-1].argmax()) if forced is None else forced[i])
        out.append(runner.step([(row, [toks[-1]])])[0][-1])
    assert runner.pool.k_buffers[0].dtype == kv_dtype
    return torch.stack(out), toks


@pytest.fixture(scope="module")
def embedded():
    from transformers import AutoTokenizer

    from llmkit.core.model.loader.source import resolve_model_dir

    path = resolve_model_dir(None)
    tok = AutoTokenizer.from_pretrained(str(path))
    messages = [{"role": "user", "content": "Write a short poem about the sea and the wind."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    model = load_ours(path)
    ref, toks = _greedy_logits(model, ids, torch.float32, 16)
    return model, ids, ref, toks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_embedded_model_logits_with_a_smaller_kv_cache(embedded, dtype):
    model, ids, ref, toks = embedded
    got, _ = _greedy_logits(model, ids, dtype, 16, forced=toks)
    err = (got - ref).abs().max().item()
    assert err <= logit_tol(dtype), f"{dtype}: max logit change {err:.3g} > {logit_tol(dtype):.3g}"


def test_mla_latent_kv_in_bf16(tmp_path):
    save_tiny_model("deepseek_v3", tmp_path)
    model = load_ours(tmp_path)
    ids = list(range(5, 40))
    ref, toks = _greedy_logits(model, ids, torch.float32, 8)
    got, _ = _greedy_logits(model, ids, torch.bfloat16, 8, forced=toks)
    assert (got - ref).abs().max().item() <= logit_tol(torch.bfloat16)  # measured 4.4 x eps


def test_native_gguf_weights_with_a_bf16_kv_cache():
    """``--quantization gguf``: the quantized kernels round their activations to int8 in blocks of 32
    (llama.cpp's scheme), so a pool's rounding that moves an activation across one of those steps
    (1/127 of its block's largest) moves the logits by more than the pool's own precision would:
    measured 0.76 at most over these 40 x 49k logits, ~0.1 on average. Bound: 1.0; greedy may flip
    only where the top-2 gap is within 2 x that."""
    from llmkit.core.engine.builder import architecture_of, build_model
    from llmkit.core.model.loader.source import embedded_gguf_path, iter_gguf_native, load_config, resolve_model_dir
    from llmkit.core.plugins import registry

    cfg = load_config(resolve_model_dir(None, weights=False))
    model = build_model(registry().model(architecture_of(cfg)), cfg, CPU, torch.float32)
    model.load_weights(iter_gguf_native(embedded_gguf_path(), cfg))
    quantize.finalize_weights(model)
    ids = list(range(100, 140))
    ref, toks = _greedy_logits(model, ids, torch.float32, 8)
    got, _ = _greedy_logits(model, ids, torch.bfloat16, 8, forced=toks)
    assert (got - ref).abs().max().item() <= 1.0
    top2 = ref.topk(2, -1).values
    flips = got.argmax(-1) != ref.argmax(-1)
    assert not (flips & (top2[:, 0] - top2[:, 1] > 2.0)).any()


def test_engine_greedy_with_a_bf16_kv_cache_matches_fp32(embedded):
    """The whole engine (builder, scheduler, radix cache, batched decode): 24 greedy tokens with a
    bf16 pool equal the fp32 pool's, or part only where fp32's top-2 logits are within the bf16
    bound of each other (both can move by it)."""
    from model_utils import _greedy

    model, ids, _, _ = embedded
    tokens = {}
    for name in ("auto", "bfloat16"):
        engine = start_engine(device="cpu", kv_cache_dtype=name, max_total_tokens=2048, page_size=4)
        try:
            tokens[name], _ = _greedy(engine, f"kv-{name}", ids, 24)
            assert engine.stats()["kv_cache_dtype"] == ("float32" if name == "auto" else "bfloat16")
        finally:
            engine.shutdown()
    ours, theirs = tokens["bfloat16"], tokens["auto"]
    if ours != theirs:
        step = next(j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        logits, _ = _greedy_logits(model, ids + theirs[:step], torch.float32, 0)
        top2 = logits[0].topk(2).values
        assert (top2[0] - top2[1]).item() < 2 * logit_tol(torch.bfloat16), f"diverged at step {step} without a tie"


# -- the server --------------------------------------------------------------------------------


def test_serve_with_a_bf16_kv_cache():
    proc, url = start_server(["--kv-cache-dtype", "bfloat16", "--batch-storage", "none"])
    try:
        server = Server(proc, url)
        info = server.info()
        assert info["kv_cache_dtype"] == "bfloat16"
        assert "bfloat16), context" in server.log()  # the start-up line names the pool's dtype
        body = dict(
            model="m",
            messages=[{"role": "user", "content": "Name three colours."}],
            max_tokens=24,
            temperature=0,
        )
        whole = server.client.chat.completions.create(**body)
        text = whole.choices[0].message.content
        assert text and whole.usage.completion_tokens > 0
        chunks = server.client.chat.completions.create(**body, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    finally:
        stop_server(proc)


def test_a_bad_value_is_a_one_line_error_before_loading():
    from llmkit.cli.main import app

    res = CliRunner().invoke(app, ["serve", "--kv-cache-dtype", "int8"])
    assert res.exit_code == 2, res.output
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: unknown --kv-cache-dtype 'int8'"), res.stderr
    assert "bfloat16" in lines[0] and "fp8_e4m3" in lines[0]


# -- CUDA --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("seqs", [[(13, 7), (0, 9)], [(15, 1), (32, 1)]], ids=["extend", "decode"])
def test_triton_reads_a_pool_of_another_dtype_like_torch(kv_dtype, seqs):
    """bf16 queries over an fp16 or fp8 pool: both backends store rounded values and convert on read."""
    from llmkit.plugins.attention.torch_backend import TorchAttentionBackend
    from llmkit.plugins.attention.triton_backend import TritonAttentionBackend

    from attention_utils import backend_kwargs, build_batch

    if kv_dtype in FP8 and TritonAttentionBackend.kv_cache_dtype_support(kv_dtype, torch.device("cuda")):
        pytest.skip("fp8 needs compute capability 8.9+")
    b = build_batch(seqs, num_heads=4, num_kv_heads=2, head_dim=32, page_size=4, dtype=torch.bfloat16, device="cuda")
    b.pool.k_buffers[0] = b.pool.k_buffers[0].to(kv_dtype)
    b.pool.v_buffers[0] = b.pool.v_buffers[0].to(kv_dtype)
    outs = []
    for cls in (TritonAttentionBackend, TorchAttentionBackend):
        b.md.extra.clear()
        backend = cls(**backend_kwargs(b, 4))
        outs.append(backend.forward(b.q, b.k, b.v, 0, backend.prepare_metadata(b.md)).float())
    assert (outs[0] - outs[1]).abs().max().item() <= 3e-2  # the bf16 tolerance of test_triton_attention
