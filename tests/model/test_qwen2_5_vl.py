"""Qwen2.5-VL against transformers: the vision tower, the processor's M-RoPE layout, and the
logits of prompts with zero, one and two images through the paged KV path (prefill, a prefill
split inside an image, decode steps rotating by ``p + rope_delta``)."""

from __future__ import annotations

import pytest
import torch

from llmkit.core.model import quantize
from llmkit.core.model.cpu import cpu_decoder
from llmkit.core.model.loader.source import iter_safetensors, load_config

from model_utils import load_ours
from paged_runner import PagedRunner
from vl_utils import (
    IMAGE_TOKEN_ID,
    SPECIAL,
    assert_logits_close,
    chat_prompt,
    engine_ids,
    grid_of,
    load_vl,
    mm_rows,
    reference_logits,
    save_tiny_qwen2_5_vl,
)

SIZES = [(56, 84), (112, 56), (140, 168)]  # (height, width): 6, 8 and 30 tokens


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    return load_vl(tmp_path_factory.mktemp("qwen2_5_vl"), save_tiny_qwen2_5_vl, SIZES)


def test_vision_tower_matches_transformers(vl):
    items = [vl["proc"].preprocess(im) for im in vl["images"]]
    assert [item.meta["grid_thw"] for item in items] == [(1, 4, 6), (1, 8, 4), (1, 10, 12)]
    ours = vl["model"].encode_images(items)  # one batched pass over three sizes
    with torch.no_grad():
        pixels = torch.cat([item.pixel_values for item in items])
        theirs = vl["ref"].model.get_image_features(pixels, grid_of(items)).pooler_output
    assert [o.shape[0] for o in ours] == [item.num_tokens for item in items] == [6, 8, 30]
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert_logits_close(a, b, f"image {i}")
    alone = vl["model"].encode_images(items[2:])[0]  # an image's rows do not depend on its batch
    assert_logits_close(alone, ours[2], "image 2 alone")


def test_processor_items_and_rope_layout_match_transformers(vl):
    proc = vl["proc"]
    assert proc.placeholder_id == IMAGE_TOKEN_ID and proc.placeholder_text == "<|image_pad|>"
    a, b = proc.preprocess(vl["images"][0]), proc.preprocess(vl["images"][0])
    assert a.digest == b.digest and a.digest != proc.preprocess(vl["images"][1]).digest
    ids, inputs, items = chat_prompt(vl, 2)
    assert ids.count(IMAGE_TOKEN_ID) == 6 + 8
    for (off, n), item in zip(inputs.spans, items):
        assert n == item.num_tokens and ids[off - 1] == SPECIAL["<|vision_start|>"]
        assert ids[off : off + n] == [IMAGE_TOKEN_ID] * n and ids[off + n] == SPECIAL["<|vision_end|>"]
    t = torch.tensor([ids])
    pos, delta = vl["ref"].model.get_rope_index(t, (t == IMAGE_TOKEN_ID).int(), grid_of(items))
    assert torch.equal(torch.tensor(inputs.rope_positions), pos[:, 0])
    assert inputs.rope_delta == int(delta) < 0
    raw = vl["tok"](vl["tok"].apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False))["input_ids"]
    with pytest.raises(ValueError, match="placeholder"):
        proc.expand(raw, items[:1])
    same, none = proc.expand(raw, [])
    assert same == raw and none.rope_positions is None


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_logits_match_transformers_prefill_then_decode(vl, n_images):
    ids, inputs, items = chat_prompt(vl, n_images)
    model = vl["model"]
    embeds = torch.cat(model.encode_images(items)) if items else None
    eng = engine_ids(ids, inputs)
    gen = [SPECIAL["<|im_start|>"], 77, 300]  # decoded tokens, as if sampled
    full = reference_logits(vl, ids + gen, items)
    runner = PagedRunner(model, 16)
    row = runner.new_seq()
    (logits,) = runner.step([(row, eng)], mm=mm_rows(inputs, embeds, 0, len(eng)))
    assert_logits_close(logits, full[: len(ids)], "prefill")
    for j, tok in enumerate(gen):
        p = len(ids) + j
        (logits,) = runner.step([(row, [tok])], mm=mm_rows(inputs, embeds, p, 1))
        assert_logits_close(logits, full[p : p + 1], f"decode step {j}")


def test_prefill_split_inside_an_image_and_batched_decode(vl):
    """Two images; the first chunk ends in the middle of the second image. A text-only sequence
    decodes in the same batches (its rows carry plain positions in the shared ``ctx.mm``)."""
    ids, inputs, items = chat_prompt(vl, 2, first=1)  # the 8- and 30-token images
    model = vl["model"]
    embeds = torch.cat(model.encode_images(items))
    eng = engine_ids(ids, inputs)
    off, n = inputs.spans[1]
    cut = off + n // 2
    full = reference_logits(vl, ids + [9, 12], items)
    runner = PagedRunner(model, 16)
    a = runner.new_seq()
    (first,) = runner.step([(a, eng[:cut])], mm=mm_rows(inputs, embeds, 0, cut))
    assert_logits_close(first, full[:cut], "chunk 1")
    (second,) = runner.step([(a, eng[cut:])], mm=mm_rows(inputs, embeds, cut, len(eng) - cut))
    assert_logits_close(second, full[cut : len(ids)], "chunk 2")
    # a text sequence beside it: its rows rotate by plain positions on all three axes
    text_ids, text_inputs, _ = chat_prompt(vl, 0)
    text_full = reference_logits(vl, text_ids + [5], [])
    b = runner.new_seq()
    (lb,) = runner.step([(b, text_ids)])
    assert_logits_close(lb, text_full[: len(text_ids)], "text prefill")
    for j, (ta, tb) in enumerate(((9, 5), (12, None))):
        pa, pb = len(ids) + j, len(text_ids) + j
        ma = mm_rows(inputs, embeds, pa, 1)
        batch = [(a, [ta])]
        if tb is not None:
            batch.append((b, [tb]))
            rope_b = torch.full((3, 1), pb, dtype=torch.int64)
            ma.rope_positions = torch.cat((ma.rope_positions, rope_b), dim=1)
            ma.mask = torch.cat((ma.mask, torch.zeros(1, dtype=torch.bool)))
        out = runner.step(batch, mm=ma)
        assert_logits_close(out[0], full[pa : pa + 1], f"decode {j}")
        if tb is not None:
            assert_logits_close(out[1], text_full[pb : pb + 1], f"text decode {j}")


@pytest.mark.skipif(not cpu_decoder.available(), reason="no C compiler: the Python layers run")
def test_native_stack_runs_the_mrope_table_as_the_python_layers(vl):
    """The C decoder stack (int4 weights) takes the M-RoPE table as the plain one: an image
    prompt's prefill and a decode step equal the Python layers' exactly."""
    ids, inputs, items = chat_prompt(vl, 1)
    model = load_ours(vl["path"])
    quantize.quantize(model, "int4", 32)
    embeds = torch.cat(model.encode_images(items))
    eng = engine_ids(ids, inputs)
    outs = []
    for native in (True, False):
        model.native_stack, model._native_plan = native, False
        runner = PagedRunner(model, 16)
        row = runner.new_seq()
        out = runner.step([(row, eng)], mm=mm_rows(inputs, embeds, 0, len(eng)))
        out += runner.step([(row, [7])], mm=mm_rows(inputs, embeds, len(eng), 1))
        assert (model._native_plan is not None) == native
        outs.append(out)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_loads_the_transformers5_weight_layout(vl):
    """``model.language_model.*`` / ``model.visual.*`` (transformers 5's module names) load as
    the on-disk ``model.layers.*`` / ``visual.*`` do."""
    from llmkit.core.engine.builder import build_model

    def renamed():
        for name, t in iter_safetensors(vl["path"]):
            if name.startswith("visual."):
                yield "model." + name, t
            elif name.startswith("model."):
                yield "model.language_model." + name.removeprefix("model."), t
            else:
                yield name, t

    config = load_config(vl["path"])
    other = build_model(type(vl["model"]), config, torch.device("cpu"), torch.float32)
    other.load_weights(renamed())
    theirs = dict(vl["model"].named_parameters())
    for name, p in other.named_parameters():
        assert torch.equal(p, theirs[name]), name
    with pytest.raises(KeyError, match="missing"):
        fresh = build_model(type(vl["model"]), config, torch.device("cpu"), torch.float32)
        fresh.load_weights((n, t) for n, t in iter_safetensors(vl["path"]) if "merger" not in n)


def test_model_directory_is_servable(vl):
    import json

    from transformers import AutoImageProcessor, AutoTokenizer

    path = vl["path"]
    tok = AutoTokenizer.from_pretrained(str(path))
    assert AutoImageProcessor.from_pretrained(str(path)).merge_size == 2
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert config["image_token_id"] == tok.convert_tokens_to_ids("<|image_pad|>") < config["text_config"]["vocab_size"]
    for text, i in SPECIAL.items():
        assert tok.convert_tokens_to_ids(text) == i
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:..."}},
                {"type": "image"},
                {"type": "text", "text": "hi"},
            ],
        }
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    assert text.endswith("<|im_start|>assistant\n")
    gen = json.loads((path / "generation_config.json").read_text())
    assert SPECIAL["<|im_end|>"] in gen["eos_token_id"]


def test_transformers4_flat_config_with_mrope_rope_scaling(vl):
    """Released checkpoints' config.json: the text settings at the top level and
    ``rope_scaling: {"type": "mrope", "mrope_section": [...]}``; the same model as the nested one."""
    from llmkit.core.engine.builder import build_model

    nested = load_config(vl["path"])
    text = nested["text_config"]
    flat = {k: v for k, v in nested.items() if k != "text_config"}
    flat.update({k: v for k, v in text.items() if k != "rope_parameters"})
    flat.update(rope_theta=text["rope_parameters"]["rope_theta"])
    flat.update(rope_scaling={"type": "mrope", "mrope_section": text["rope_parameters"]["mrope_section"]})
    model = build_model(type(vl["model"]), flat, torch.device("cpu"), torch.float32)
    model.load_weights(iter_safetensors(vl["path"]))
    ids, inputs, items = chat_prompt(vl, 1)
    embeds = torch.cat(model.encode_images(items))
    eng = engine_ids(ids, inputs)
    outs = []
    for m in (model, vl["model"]):
        runner = PagedRunner(m, 16)
        outs.append(runner.step([(runner.new_seq(), eng)], mm=mm_rows(inputs, embeds, 0, len(eng)))[0])
    assert torch.equal(outs[0], outs[1])
