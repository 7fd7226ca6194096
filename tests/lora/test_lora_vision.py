"""LoRA adapters of vision-language models: a PEFT adapter of Qwen2.5-VL or Gemma 3 names the
decoder ``model.language_model.layers.*`` (transformers 5); served over the model, a
request with an image gives transformers' greedy tokens with the adapter merged, and the base
model's without it. An adapter of the vision encoder is refused, naming it."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from PIL import Image

from gemma3_utils import save_tiny_gemma3
from server_utils import start_server, stop_server
from vl_utils import IMAGE_TOKEN_ID, data_url, save_tiny_qwen2_5_vl

pytestmark = pytest.mark.slow  # a server of a tiny vision-language model

TEXT_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
PICTURE = Image.new("RGB", (84, 56), (200, 40, 40))
QUESTION = "What is in the picture?"


def _adapter(hf, path, targets) -> object:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(str(path))
    return model


def _greedy(model, path, n: int) -> list[int]:
    """transformers' greedy tokens for the chat with the picture (as tests/multimodal does it)."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    tmpl = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = tok.apply_chat_template(tmpl, add_generation_prompt=True, tokenize=False)
    if model.config.model_type == "gemma3":
        proc = AutoProcessor.from_pretrained(str(path), image_seq_length=model.config.mm_tokens_per_image)
        inputs = proc(text=[text], images=[PICTURE], return_tensors="pt")
    else:  # Qwen's AutoProcessor wants torchvision for video: the image processor and the tokenizer
        pixels = AutoImageProcessor.from_pretrained(str(path))(images=[PICTURE], return_tensors="pt")
        text = text.replace("<|image_pad|>", "<|image_pad|>" * (int(pixels["image_grid_thw"].prod()) // 4))
        inputs = {**tok(text, return_tensors="pt", add_special_tokens=False), **pixels}
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == IMAGE_TOKEN_ID).int()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


# the two layouts: Qwen-VL's decoder is the model's own (Qwen3-VL names it as Qwen2.5-VL does),
# Gemma 3's sits under language_model
BUILDERS = {"qwen2_5_vl": save_tiny_qwen2_5_vl, "gemma3": save_tiny_gemma3}


@pytest.mark.parametrize("family", BUILDERS)
def test_a_language_model_adapter_serves_image_requests(tmp_path, family):
    from transformers import AutoTokenizer

    build = BUILDERS[family]
    hf = build(tmp_path / "vl")
    base = _greedy(hf, tmp_path / "vl", 8)
    peft_model = _adapter(hf, tmp_path / "text", TEXT_TARGETS)
    merged = peft_model.merge_and_unload()
    want = _greedy(merged, tmp_path / "vl", 8)
    assert want != base  # the adapter changes the answer
    hf = build(tmp_path / "vl2")  # a fresh copy: merging changed the one above
    _adapter(hf, tmp_path / "vision", ["k_proj", "down_proj", "linear_fc1"])  # the vision blocks' too
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "vl"))

    proc, url = start_server(["--model-path", str(tmp_path / "vl"), "--lora-paths", f"text={tmp_path / 'text'}"])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        image = {"type": "image_url", "image_url": {"url": data_url(PICTURE)}}
        messages = [{"role": "user", "content": [image, {"type": "text", "text": QUESTION}]}]
        extra = {"ignore_eos": True, "skip_special_tokens": False}
        for model, tokens in (("text", want), ("m", base)):
            r = client.chat.completions.create(
                model=model, messages=messages, max_tokens=8, temperature=0, extra_body=extra
            )
            assert r.choices[0].message.content == tok.decode(tokens, skip_special_tokens=False), model
        body = {"lora_name": "vision", "lora_path": str(tmp_path / "vision")}
        r = httpx.post(url + "/load_lora_adapter", json=body, timeout=60)
        assert r.status_code == 400 and "adapts the vision encoder" in r.text, r.text
    finally:
        stop_server(proc)
