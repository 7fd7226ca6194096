"""The C decoder stack (core/model/cpu/cpu_decoder.c): the blocks of a Llama-style model in one C call.
It calls the same kernels as the Python layers in the same order, so every step's logits and every
K/V byte it writes must equal the Python path's exactly: prompts, a prompt beside a decode row,
batched decode, in fp32 and bf16 pools, on the embedded model at its native precision and on tiny
models (int4 with a QKV bias, int8 without a dense copy, both in one model)."""

from __future__ import annotations

import pytest
import torch

from llmkit.core.model import quantize
from llmkit.core.model.cpu import cpu_decoder
from llmkit.core.model.quant.int8 import Int8Format

from model_utils import load_ours, save_tiny_model
from paged_runner import PagedRunner

pytestmark = pytest.mark.skipif(not cpu_decoder.available(), reason="no C compiler: the Python layers run")


def _scenario(model, native: bool, kv_dtype, vocab: int):
    """Logits of: a 20-token prompt; its decode row beside a second 13-token prompt; three batched
    decode steps. Returns them with the K/V rows both sequences wrote."""
    model.native_stack, model._native_plan = native, False
    ids = [(37 * i + 11) % vocab for i in range(40)]
    r = PagedRunner(model, 16, kv_dtype=kv_dtype)
    a, b = r.new_seq(), r.new_seq()
    out = r.step([(a, ids[:20])])
    out += r.step([(a, [ids[20]]), (b, ids[:13])])
    for i in range(3):
        out += r.step([(a, [ids[21 + i]]), (b, [ids[13 + i]])])
    assert (model._native_plan is not None) == native  # the stack ran (or, off, did not)
    slots = torch.cat([r.req_pool.table[row, : r.lens[row]] for row in (a, b)])
    return out, [buf[slots] for buf in r.pool.k_buffers + r.pool.v_buffers]


def _assert_same_as_python_layers(model, vocab: int) -> None:
    for kv_dtype in (torch.float32, torch.bfloat16):
        got, got_kv = _scenario(model, True, kv_dtype, vocab)
        ref, ref_kv = _scenario(model, False, kv_dtype, vocab)
        assert all(torch.equal(x, y) for x, y in zip(got, ref)), kv_dtype
        assert all(torch.equal(x, y) for x, y in zip(got_kv, ref_kv)), kv_dtype


@pytest.fixture(scope="module")
def embedded_native():
    from llmkit.core.engine.builder import architecture_of, build_model
    from llmkit.core.model.loader.source import embedded_gguf_path, iter_gguf_native, load_config, resolve_model_dir
    from llmkit.core.plugins import registry

    cfg = load_config(resolve_model_dir(None, weights=False))
    model = build_model(registry().model(architecture_of(cfg)), cfg, torch.device("cpu"), torch.float32)
    model.load_weights(iter_gguf_native(embedded_gguf_path(), cfg))
    quantize.finalize_weights(model)
    return model


def test_embedded_model_stack_equals_the_python_layers(embedded_native):
    _assert_same_as_python_layers(embedded_native, 5000)


def test_int4_with_qkv_bias_and_int8_without_dense_copy(tmp_path):
    save_tiny_model("qwen2", tmp_path)  # Qwen2: a bias on the fused QKV projection
    model = load_ours(tmp_path)
    quantize.quantize(model, "int4", 32)
    for layer in model.layers[1:]:  # int8 as a GGUF's Q8_0 leaves it: no dense copy
        for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
            lin.set_format(Int8Format(keep_dense=False))
    model._native_plan = False
    assert model.layers[0].self_attn.qkv_proj.bias is not None
    _assert_same_as_python_layers(model, 512)


def test_formats_without_a_kernel_at_every_row_count_keep_the_python_layers(tmp_path):
    save_tiny_model("llama", tmp_path)
    model = load_ours(tmp_path)
    assert model._native_blocks() is None  # dense fp32 weights
    quantize.quantize(model, "int8")  # keeps a dense copy for many rows
    assert model._native_blocks() is None
    model = load_ours(tmp_path)
    quantize.quantize(model, "int4", 32)
    assert model._native_blocks() is not None
    model.native_stack = False
    assert model._native_blocks() is None


def test_qk_norm_models_keep_the_python_layers(tmp_path):
    save_tiny_model("qwen3", tmp_path)
    model = load_ours(tmp_path)
    quantize.quantize(model, "int4", 32)
    assert model._native_blocks() is None
