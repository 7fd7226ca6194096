"""Qwen3.5 / Qwen3.6 image-text against transformers: the vision tower (Qwen3-VL's without
DeepStack), the processor's positions, the logits of prompts with zero, one and two images through
the paged KV path with the DeltaNet layers' state slots (interleaved M-RoPE over the rotated quarter
of each head, a prefill split inside an image, decode steps at ``p + rope_delta``), the MoE model,
the real engine's greedy output, resumed from the prefix cache past an image, and ``--tp-size 2``
serving the language model alone."""

from __future__ import annotations

import threading

import pytest
import torch

from llmkit.core.engine.messages import GenerateRequest, SamplingParams

from model_utils import start_engine
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
    save_tiny_qwen3_5_vl,
)

SIZES = [(64, 96), (128, 64), (160, 192)]  # (height, width): 6, 8 and 30 tokens


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    return load_vl(tmp_path_factory.mktemp("qwen3_5_vl"), save_tiny_qwen3_5_vl, SIZES)


def test_vision_tower_matches_transformers(vl):
    items = [vl["proc"].preprocess(im) for im in vl["images"]]
    assert [item.meta["grid_thw"] for item in items] == [(1, 4, 6), (1, 8, 4), (1, 10, 12)]
    ours = vl["model"].encode_images(items)
    with torch.no_grad():
        pixels = torch.cat([item.pixel_values for item in items])
        theirs = vl["ref"].model.get_image_features(pixels, grid_of(items)).pooler_output
    hidden = vl["model"].config["hidden_size"]
    for i, (row, want) in enumerate(zip(ours, theirs)):
        assert row.shape == (items[i].num_tokens, hidden)  # no DeepStack levels
        assert_logits_close(row, want, f"image {i}")


def test_rope_layout_and_rotary_width(vl):
    ids, inputs, items = chat_prompt(vl, 2)
    t = torch.tensor([ids])
    pos, delta = vl["ref"].model.get_rope_index(t, (t == IMAGE_TOKEN_ID).int(), grid_of(items))
    assert torch.equal(torch.tensor(inputs.rope_positions), pos[:, 0])
    assert inputs.rope_delta == int(delta)
    # the M-RoPE table covers the rotated 16 of 64 channels: t h w t h w t h per half
    assert vl["model"].mrope_axis.tolist() == [0, 1, 2, 0, 1, 2, 0, 1] * 2


def _check_prefill_then_decode(vl, model, n_images: int, cut: int | None = None):
    """Our logits for a chat prompt (prefilled whole, or in two chunks at ``cut``), then three
    decode steps, equal transformers' over the whole sequence."""
    ids, inputs, items = chat_prompt(vl, n_images, first=1 if cut else 0)
    embeds = torch.cat(model.encode_images(items)) if items else None
    eng = engine_ids(ids, inputs)
    gen = [501, 77, 300]
    full = reference_logits(vl, ids + gen, items)
    runner = PagedRunner(model, 16)
    row = runner.new_seq()
    bounds = [0, len(eng)] if cut is None else [0, cut(inputs), len(eng)]
    for a, b in zip(bounds, bounds[1:]):
        (logits,) = runner.step([(row, eng[a:b])], mm=mm_rows(inputs, embeds, a, b - a))
        assert_logits_close(logits, full[a:b], f"prefill {a}:{b}")
    for j, tok in enumerate(gen):
        p = len(ids) + j
        (logits,) = runner.step([(row, [tok])], mm=mm_rows(inputs, embeds, p, 1))
        assert_logits_close(logits, full[p : p + 1], f"decode step {j}")


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_logits_match_transformers_prefill_then_decode(vl, n_images):
    _check_prefill_then_decode(vl, vl["model"], n_images)


def test_prefill_split_inside_an_image(vl):
    """The DeltaNet states carried across a chunk boundary in the middle of an image's tokens
    (image tokens attend causally: the scheduler may end a chunk there)."""
    assert not chat_prompt(vl, 1)[1].bidirectional
    _check_prefill_then_decode(vl, vl["model"], 2, cut=lambda inputs: inputs.spans[1][0] + inputs.spans[1][1] // 2)


def test_moe_logits_match_transformers(tmp_path):
    """Qwen3.5-MoE's image-text model: the same vision path on the routed-expert decoder."""
    moe = load_vl(tmp_path, lambda p: save_tiny_qwen3_5_vl(p, moe=True), SIZES[:1])
    assert type(moe["model"]).__name__ == "Qwen3_5MoeForConditionalGeneration"
    _check_prefill_then_decode(moe, moe["model"], 1)


# --- the engine ---------------------------------------------------------------------------------


def _greedy(engine, rid: str, ids: list[int], inputs, n: int) -> tuple[list[int], int]:
    done, out, cached = threading.Event(), [], []

    def sink(o):
        out.extend(o.token_ids)
        if o.finished:
            assert o.error is None, o.error
            cached.append(o.cached_tokens)
            done.set()

    params = SamplingParams(max_new_tokens=n, min_new_tokens=n, temperature=0)
    engine.submit(GenerateRequest(rid, ids, params, mm=inputs), sink)
    assert done.wait(300)
    return out, cached[0]


def test_engine_greedy_matches_generate_and_resumes_past_the_image(vl):
    """Through the real engine (pages of 4, prompt chunks of 16, a state snapshot every 16
    tokens): a prompt with two images gives transformers' ``generate`` tokens; the same prompt
    again resumes from the prefix cache, past both images, with the same output."""
    ids, inputs, items = chat_prompt(vl, 2)
    n = 8
    t = torch.tensor([ids])
    with torch.no_grad():
        gen = vl["ref"].generate(
            t,
            pixel_values=torch.cat([item.pixel_values for item in items]),
            image_grid_thw=grid_of(items),
            mm_token_type_ids=(t == IMAGE_TOKEN_ID).int(),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
        )
    want = gen[0, len(ids) :].tolist()
    engine = start_engine(
        model_path=str(vl["path"]),
        device="cpu",
        page_size=4,
        chunked_prefill_size=16,
        max_total_tokens=2048,
        state_snapshot_interval=16,
        max_running_requests=4,
    )
    try:
        first, cached = _greedy(engine, "a", ids, inputs, n)
        assert first == want and cached == 0
        again, cached = _greedy(engine, "b", ids, inputs, n)
        assert again == want
        assert cached > inputs.spans[1][0] + inputs.spans[1][1]  # past the second image
    finally:
        engine.shutdown()


# --- tensor parallelism: the language model alone -------------------------------------------------


def test_tensor_parallel_resolves_to_the_language_model(vl):
    """The vision tower is not sharded: under ``--tp-size N`` the image-text checkpoint is served
    as its text model (as before it took images) and the server builds no image processor."""
    from llmkit.core.engine.stages.plan import model_class
    from llmkit.core.launch import _multimodal
    from llmkit.core.model.loader.source import load_config
    from llmkit.core.server.config import ServerConfig
    from llmkit.plugins.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    config = load_config(vl["path"])
    assert model_class(config) is Qwen3_5ForConditionalGeneration
    assert model_class(config, tp_size=2) is Qwen3_5ForCausalLM
    assert _multimodal(vl["path"], vl["tok"], ServerConfig())[0] is not None
    assert _multimodal(vl["path"], vl["tok"], ServerConfig(), tp_size=2)[0] is None


@pytest.mark.slow  # two ranks in processes of their own
def test_served_tp2_answers_text_and_refuses_images(vl):
    """``llmkit serve --tp-size 2`` on the image-text checkpoint: a text prompt's greedy tokens
    equal transformers' ``generate``; an image is a 400 naming the part."""
    import openai

    from server_utils import start_server, stop_server
    from vl_utils import data_url

    ids = [(29 * j) % 500 + 3 for j in range(20)]
    with torch.no_grad():
        want = vl["ref"].generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    proc, url = start_server(["--model-path", str(vl["path"]), "--tp-size", "2", "--batch-storage", "none"])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = client.completions.create(
            model="m", prompt=ids, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].text == vl["tok"].decode(want[0, len(ids) :])
        image = {"type": "image_url", "image_url": {"url": data_url(vl["images"][0])}}
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[0\]"):
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}], max_tokens=2
            )
    finally:
        stop_server(proc)
