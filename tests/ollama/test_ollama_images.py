"""Images as Ollama sends them (bare base64 in a message's ``images``) reach a vision model: a
tiny random-weight Qwen2.5-VL served for real; the greedy reply equals the OpenAI route's for the
same image as a data URL, and differs with another image."""

from __future__ import annotations

import ollama
import openai
import pytest
from PIL import Image

from server_utils import start_server, stop_server
from vl_utils import data_url, png_b64, save_tiny_qwen2_5_vl

GREEDY = {"temperature": 0, "num_predict": 8}


def _image(seed: int) -> Image.Image:
    return Image.frombytes("RGB", (56, 56), bytes((i * (31 + seed) + seed * 97) % 251 for i in range(56 * 56 * 3)))


RED, BLUE = _image(1), _image(2)


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    model = tmp_path_factory.mktemp("vl") / "model"
    save_tiny_qwen2_5_vl(model)
    proc, base = start_server(["--model-path", str(model), "--batch-storage", "none", "--disable-web-ui"])
    try:
        yield base
    finally:
        stop_server(proc)


def test_images_reach_the_vision_model(url):
    client = ollama.Client(host=url, timeout=300)
    oai = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    r = client.chat(
        model="m", messages=[{"role": "user", "content": "What is it?", "images": [png_b64(RED)]}], options=GREEDY
    )
    parts = [{"type": "image_url", "image_url": {"url": data_url(RED)}}, {"type": "text", "text": "What is it?"}]
    ref = oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": parts}], temperature=0, max_tokens=8
    )
    assert r.message.content == ref.choices[0].message.content
    assert r.prompt_eval_count == ref.usage.prompt_tokens
    g = client.generate(model="m", prompt="What is it?", images=[png_b64(RED)], options=GREEDY)
    assert g.response == r.message.content  # the same conversation through /api/generate
    other = client.generate(model="m", prompt="What is it?", images=[png_b64(BLUE)], options=GREEDY)
    assert other.response != g.response
    assert "vision" in client.show("m").capabilities
