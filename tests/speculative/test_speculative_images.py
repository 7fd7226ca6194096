"""Speculative decoding on requests with images: a vision-language target's answers under
``STANDALONE`` and ``EAGLE`` equal its answers without speculation, and both draft for them.

The draft model is the tiny Qwen2.5-VL's own language model saved as a plain Qwen2 (so its drafts
are often right, and both kept and rejected drafts occur); the EAGLE head is a random one of the
model's width. Both read each image's tokens as the image placeholder token, since the pictures'
pseudo-ids have no row in an embedding (before, an image request under STANDALONE failed with a
500, and heads did not draft for one)."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
import torch
from eagle_heads import head_tensors, save_head
from PIL import Image

from server_utils import start_server, stop_server
from vl_utils import data_url, save_tiny_qwen2_5_vl

pytestmark = pytest.mark.slow  # two servers of a tiny vision-language model


def _save_text_model_as_qwen2(hf, path) -> None:
    import transformers

    t = hf.config.text_config
    shape = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    shape += ("num_key_value_heads", "max_position_embeddings", "rms_norm_eps")
    config = transformers.Qwen2Config(**{k: getattr(t, k) for k in shape}, tie_word_embeddings=False)
    draft = transformers.Qwen2ForCausalLM(config)
    missing, unexpected = draft.model.load_state_dict(hf.model.language_model.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    with torch.no_grad():
        draft.lm_head.weight.copy_(hf.lm_head.weight)
    draft.save_pretrained(str(path), safe_serialization=True)


def _picture(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (56, 84, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl-spec")
    hf = save_tiny_qwen2_5_vl(root / "vl")
    _save_text_model_as_qwen2(hf, root / "draft")
    save_head(root / "eagle", head_tensors())
    return root


def _answers(url: str) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    out = []
    for seed in (1, 2):
        content = [
            {"type": "text", "text": "Say what is in the picture:"},
            {"type": "image_url", "image_url": {"url": data_url(_picture(seed))}},
            {"type": "text", "text": "and repeat this: abc abc abc"},
        ]
        r = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": content}],
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        out.append(r.choices[0].message.content)
    return out


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    (line,) = [ln for ln in text.splitlines() if ln.split("{")[0].split(" ")[0] in (name, name + "_total")]
    return float(line.split()[-1])


@pytest.fixture(scope="module")
def plain(dirs):
    proc, url = start_server(["--model-path", str(dirs / "vl"), "--batch-storage", "none"])
    try:
        return _answers(url)
    finally:
        stop_server(proc)


@pytest.mark.parametrize("algorithm, draft", [("STANDALONE", "draft"), ("EAGLE", "eagle")])
def test_image_requests_draft_and_answer_as_without_speculation(dirs, plain, algorithm, draft):
    args = ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", str(dirs / draft)]
    proc, url = start_server(["--model-path", str(dirs / "vl"), "--batch-storage", "none", *args])
    try:
        assert _answers(url) == plain
        drafted = _metric(url, "llmkit:spec_decode_num_draft_tokens")
        accepted = _metric(url, "llmkit:spec_decode_num_accepted_tokens")
        assert drafted > 0 and accepted < drafted, (drafted, accepted)
        if algorithm == "STANDALONE":  # the target's own language model: often right
            assert accepted > 0
    finally:
        stop_server(proc)
