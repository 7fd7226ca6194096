"""Qwen3-VL against transformers: the vision tower with its DeepStack levels, the processor's
positions, and the logits of prompts with zero, one and two images through the paged KV path
(interleaved M-RoPE, DeepStack rows added after the first decoder layers, a prefill split inside
an image, decode steps at ``p + rope_delta``)."""

from __future__ import annotations

import pytest
import torch

from paged_runner import PagedRunner
from vl_utils import (
    IMAGE_TOKEN_ID,
    assert_logits_close,
    chat_prompt,
    engine_ids,
    grid_of,
    load_vl,
    mm_rows,
    reference_logits,
    save_tiny_qwen3_vl,
)

SIZES = [(64, 96), (128, 64), (160, 192)]  # (height, width): 6, 8 and 30 tokens


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    return load_vl(tmp_path_factory.mktemp("qwen3_vl"), save_tiny_qwen3_vl, SIZES)


def test_vision_tower_and_deepstack_levels_match_transformers(vl):
    items = [vl["proc"].preprocess(im) for im in vl["images"]]
    assert [item.meta["grid_thw"] for item in items] == [(1, 4, 6), (1, 8, 4), (1, 10, 12)]
    ours = vl["model"].encode_images(items)
    with torch.no_grad():
        pixels = torch.cat([item.pixel_values for item in items])
        out = vl["ref"].model.get_image_features(pixels, grid_of(items))
    hidden = vl["model"].config["hidden_size"]
    assert vl["model"].deepstack_levels == len(out.deepstack_features) == 2
    for i, row in enumerate(ours):
        assert row.shape == (items[i].num_tokens, 3 * hidden)
        levels = [out.pooler_output[i]] + [level[i] for level in out.deepstack_features]
        for j, theirs in enumerate(levels):
            assert_logits_close(row[:, j * hidden : (j + 1) * hidden], theirs, f"image {i} level {j}")


def test_rope_layout_matches_transformers(vl):
    ids, inputs, items = chat_prompt(vl, 2)
    t = torch.tensor([ids])
    pos, delta = vl["ref"].model.get_rope_index(t, (t == IMAGE_TOKEN_ID).int(), grid_of(items))
    assert torch.equal(torch.tensor(inputs.rope_positions), pos[:, 0])
    assert inputs.rope_delta == int(delta)


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_logits_match_transformers_prefill_then_decode(vl, n_images):
    ids, inputs, items = chat_prompt(vl, n_images)
    model = vl["model"]
    embeds = torch.cat(model.encode_images(items)) if items else None
    eng = engine_ids(ids, inputs)
    gen = [501, 77, 300]
    full = reference_logits(vl, ids + gen, items)
    runner = PagedRunner(model, 16)
    row = runner.new_seq()
    (logits,) = runner.step([(row, eng)], mm=mm_rows(inputs, embeds, 0, len(eng)))
    assert_logits_close(logits, full[: len(ids)], "prefill")
    for j, tok in enumerate(gen):
        p = len(ids) + j
        (logits,) = runner.step([(row, [tok])], mm=mm_rows(inputs, embeds, p, 1))
        assert_logits_close(logits, full[p : p + 1], f"decode step {j}")


def test_prefill_split_inside_an_image(vl):
    ids, inputs, items = chat_prompt(vl, 2, first=1)
    model = vl["model"]
    embeds = torch.cat(model.encode_images(items))
    eng = engine_ids(ids, inputs)
    off, n = inputs.spans[1]
    cut = off + n // 2
    full = reference_logits(vl, ids + [9], items)
    runner = PagedRunner(model, 16)
    a = runner.new_seq()
    (first,) = runner.step([(a, eng[:cut])], mm=mm_rows(inputs, embeds, 0, cut))
    assert_logits_close(first, full[:cut], "chunk 1")
    (second,) = runner.step([(a, eng[cut:])], mm=mm_rows(inputs, embeds, cut, len(eng) - cut))
    assert_logits_close(second, full[cut : len(ids)], "chunk 2")
    (step,) = runner.step([(a, [9])], mm=mm_rows(inputs, embeds, len(eng), 1))
    assert_logits_close(step, full[len(ids) :], "decode")


def test_model_directory_is_servable(vl):
    from transformers import AutoImageProcessor, AutoTokenizer

    assert AutoImageProcessor.from_pretrained(str(vl["path"])).patch_size == 16
    tok = AutoTokenizer.from_pretrained(str(vl["path"]))
    assert tok.convert_tokens_to_ids("<|image_pad|>") == IMAGE_TOKEN_ID
