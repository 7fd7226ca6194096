"""Gemma 4 against transformers: every step of a prefill past the window, a prefix shared page-wise
(a radix-cache hit) prefilled in chunks beside decode steps, and batched decode equals
transformers' logits, for each feature of the family (dense 5:1 with wider full-layer heads, K = V,
K/V shared across layers, MoE, per-layer inputs) and the multimodal class's text path; greedy
decoding through the real engine equals ``generate``; a layer table that disagrees with the
weights fails at load naming the layer."""

from __future__ import annotations

import json

import gemma4_utils as g4
import pytest
import torch

from model_utils import assert_greedy_matches_generate, load_ours
from paged_runner import check_cached_prefix_chunked_decode

# (no pad id inside: generate would mask it out of attention)
IDS = [(37 * i + 11) % g4.VOCAB or 5 for i in range(56)]


@pytest.mark.parametrize("variant", ["dense", "k_eq_v", "kv_shared", "moe", "per_layer_input"])
def test_text_model_matches_transformers(tmp_path, variant):
    ref = g4.save_tiny_gemma4_text(tmp_path, variant)
    model = load_ours(tmp_path)
    assert type(model).__name__ == "Gemma4ForCausalLM"
    attn = [layer.self_attn for layer in model.layers]
    assert [a.sliding_window for a in attn] == [
        g4.WINDOW if t == "sliding_attention" else None for t in ref.config.layer_types
    ]
    full_kv_heads = 1 if variant == "k_eq_v" else 2
    if variant == "kv_shared":  # the last 3 layers read layers 0-2's K/V and store none
        assert model.num_kv_layers == 3 and [a.kv_source for a in attn] == [0, 1, 2, 2, 1, 1]
        assert model.kv_layer_shapes == [(2, 16, 16), (2, 32, 32), (2, 16, 16)]
    else:
        assert model.kv_layer_shapes == [(2, 16, 16)] * 5 + [(full_kv_heads, 32, 32)]
    check_cached_prefix_chunked_decode(model, ref, IDS, page_size=4)


def test_multimodal_class_text_path_matches_transformers(tmp_path):
    ref = g4.save_tiny_gemma4(tmp_path, "k_eq_v")
    model = load_ours(tmp_path)
    assert type(model).__name__ == "Gemma4ForConditionalGeneration"
    check_cached_prefix_chunked_decode(model, ref, IDS, page_size=4)


def test_pool_holds_each_layers_own_shape(tmp_path):
    """The memory planner's bytes per token are the per-layer shapes' (not layers x one shape)."""
    from llmkit.core.kvcache.kv_pool import KVCachePool

    g4.save_tiny_gemma4_text(tmp_path, "all")
    model = load_ours(tmp_path)
    shapes = model.kv_layer_shapes
    assert shapes == [(2, 16, 16), (1, 32, 32), (2, 16, 16)]
    pool = KVCachePool(
        num_layers=3, num_pages=4, page_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
        device=torch.device("cpu"), layer_shapes=shapes,
    )  # fmt: skip
    assert [tuple(b.shape[1:]) for b in pool.k_buffers] == [(2, 16), (1, 32), (2, 16)]
    assert pool.bytes_per_token() == (2 * 32 + 1 * 64 + 2 * 32) * 4


def test_greedy_decode_through_the_engine_matches_generate(tmp_path):
    """Every feature at once, through the engine (page size 16, prefill chunks of 16, radix
    cache): prompts of 40 tokens (5 windows), the second sharing the first's first 32."""
    ref = g4.save_tiny_gemma4_text(tmp_path, "all")
    second = IDS[:32] + [(11 * i + 3) % g4.VOCAB for i in range(8)]
    cached = assert_greedy_matches_generate(ref, tmp_path, [IDS[:40], second], n=12)
    assert cached[1] == 32


def _edit_config(path, **changes):
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(changes)
    cfg_path.write_text(json.dumps(cfg))


def test_a_window_table_that_disagrees_with_the_weights_names_the_layer(tmp_path):
    ref = g4.save_tiny_gemma4_text(tmp_path, "dense")
    types = list(ref.config.layer_types)
    types[2] = "full_attention"  # layer 2's weights are a sliding layer's (16-wide heads)
    _edit_config(tmp_path, layer_types=types, per_layer_config={"2": {"head_dim": 32}, "5": {"head_dim": 32}})
    with pytest.raises(ValueError, match=r"layer 2 \(full_attention\): k_norm is \[16\]"):
        load_ours(tmp_path)


def test_a_sharing_table_that_disagrees_with_the_weights_names_the_layer(tmp_path):
    g4.save_tiny_gemma4_text(tmp_path, "kv_shared", use_double_wide_mlp=False)
    _edit_config(tmp_path, num_kv_shared_layers=2)  # layer 3 would store K/V: the checkpoint has none
    with pytest.raises(KeyError, match=r"layers\.3\.self_attn\.qkv_proj"):
        load_ours(tmp_path)


def test_triton_kernels_interpreted_match_torch(tmp_path):
    """The grouped backends on the triton kernels (Triton's interpreter): sliding layers of
    16-wide heads and K = V full layers of one 32-wide K/V head, K/V shared, a cached prefix,
    chunked prefill beside decode, then decode, equal the torch backend."""
    from paged_runner import mixed_scenario, mixed_scenario_interpreted

    g4.save_tiny_gemma4_text(tmp_path, "all")
    got = mixed_scenario_interpreted(tmp_path, 4, IDS, tmp_path / "triton.pt")
    want = mixed_scenario(tmp_path, 4, IDS)
    assert len(got) == len(want) == 11
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=2e-3, rtol=2e-3), (g - w).abs().max()


@pytest.mark.parametrize("variant", ["dense", "all"])
def test_gguf_matches_transformers(tmp_path, variant):
    """llama.cpp's ``gemma4`` GGUF (written here as its converter writes one) reads back into the
    same config and weights: every step's logits equal transformers'."""
    import gguf

    from llmkit.core.engine.builder import build_model
    from llmkit.core.model import quantize
    from llmkit.core.model.loader.gguf_loader import gguf_config, gguf_tensors
    from llmkit.core.plugins import registry

    ref = g4.save_tiny_gemma4_text(tmp_path, variant)
    g4.write_gguf(ref, tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    config = gguf_config(reader)
    assert config["layer_types"] == ref.config.layer_types
    model = build_model(registry().model("Gemma4ForCausalLM"), config, torch.device("cpu"), torch.float32)
    model.load_weights(gguf_tensors(reader, config))
    quantize.finalize_weights(model)
    assert model.kv_layer_shapes == load_ours(tmp_path).kv_layer_shapes
    check_cached_prefix_chunked_decode(model, ref, IDS, page_size=4)


def test_gguf_served_through_the_engine_matches_generate(tmp_path):
    """The GGUF (tokenizer files beside it) through the engine: greedy tokens equal ``generate``."""
    ref = g4.save_tiny_gemma4_text(tmp_path, "all")
    g4.write_gguf(ref, tmp_path / "tiny.gguf")
    assert_greedy_matches_generate(ref, tmp_path / "tiny.gguf", [IDS[:40]], n=8)


def test_int8_weights_on_the_cpu_kernels_stay_close(tmp_path):
    """``--quantization int8`` converts every projection, the per-layer-input ones and the experts
    included, and prefill and decode logits stay within int8's error of transformers'."""
    from llmkit.core.model import quantize

    from paged_runner import PagedRunner

    # (per-layer inputs of 16: the int8 kernels take no fewer input features; real models have 256)
    ref = g4.save_tiny_gemma4_text(tmp_path, "all", hidden_size_per_layer_input=16)
    model = load_ours(tmp_path)
    quantize.quantize(model, "int8")
    layer = model.layers[0]
    formats = {layer.self_attn.qkv_proj.format.name, layer.per_layer_input_gate.format.name, layer.experts.format.name}
    assert formats == {"int8"}
    runner = PagedRunner(model, 4)
    row = runner.new_seq()
    (prefill,) = runner.step([(row, IDS[:40])])
    decode = [runner.step([(row, [t])])[0] for t in IDS[40:44]]  # (int8 decode kernels: one row)
    ours = torch.cat([prefill, *decode])
    with torch.no_grad():
        theirs = ref(torch.tensor([IDS[:44]])).logits[0]
    # (the tiny random model amplifies the experts' W8A8 error, ~1.5 % a layer, over its 6 layers)
    assert ((ours - theirs).norm() / theirs.norm()).item() < 0.2
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 2 / 3


def _tp_rank(rank: int, size: int, init: str, model_dir: str, out: str) -> None:
    import sys
    from pathlib import Path

    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
    from llmkit.core.engine.builder import build_model
    from llmkit.core.model import quantize
    from llmkit.core.model.loader.source import iter_safetensors, load_config
    from llmkit.core.model.parallel import TPGroup
    from llmkit.core.plugins import registry

    from paged_runner import PagedRunner

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        torch.set_num_threads(1)
        config = load_config(Path(model_dir))
        tp = TPGroup(rank=rank, size=size, group=dist.group.WORLD)
        model = build_model(registry().model("Gemma4ForCausalLM"), config, torch.device("cpu"), torch.float32, tp=tp)
        model.load_weights(iter_safetensors(Path(model_dir)))
        quantize.finalize_weights(model)
        runner = PagedRunner(model, 4)
        s = runner.new_seq()
        (prefill,) = runner.step([(s, IDS[:36])])
        decode = [runner.step([(s, [t])])[0] for t in IDS[36:40]]
        torch.save({"logits": torch.cat([prefill, *decode]), "shapes": model.kv_layer_shapes}, out)
        dist.barrier()  # leave together
    finally:
        dist.destroy_process_group()


def test_two_tensor_parallel_ranks_match_transformers(tmp_path):
    """Every feature over two ranks (gloo on CPU): query heads, the sliding layers' two K/V heads
    split, the full layers' one K = V head shared, experts' channels, the vocabulary."""
    import torch.multiprocessing as mp

    ref = g4.save_tiny_gemma4_text(tmp_path, "all")
    with torch.no_grad():
        full = ref(torch.tensor([IDS[:40]])).logits[0]
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(2)]
    ctx = mp.get_context("spawn")
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_tp_rank, args=(r, 2, init, str(tmp_path), outs[r])) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    for out in outs:
        got = torch.load(out)
        assert got["shapes"] == [(1, 16, 16), (1, 32, 32), (1, 16, 16)]
        assert torch.allclose(got["logits"], full, atol=1e-4, rtol=1e-4), (got["logits"] - full).abs().max()
