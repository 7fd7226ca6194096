"""Images through the real server, for each vision-language family (tiny random-weight models with
their real processors and chat templates), with the official ``openai`` and ``anthropic`` SDKs."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import time

import anthropic
import httpx
import openai
import pytest
from image_hosts import ImageHost
from PIL import Image

from server_utils import start_server, stop_server
from vl_utils import data_url, png_b64

FAMILIES = []
try:
    from vl_utils import save_tiny_qwen2_5_vl, save_tiny_qwen3_5_vl, save_tiny_qwen3_vl

    FAMILIES.append(("qwen2_5_vl", save_tiny_qwen2_5_vl))
    FAMILIES.append(("qwen3_vl", save_tiny_qwen3_vl))
    FAMILIES.append(("qwen3_5_vl", save_tiny_qwen3_5_vl))  # hybrid: DeltaNet states beside the images
except ImportError:  # pragma: no cover - the fixture builder lives beside the model plugin
    pass
try:
    from gemma3_utils import save_tiny_gemma3

    FAMILIES.append(("gemma3", save_tiny_gemma3))
except ImportError:  # pragma: no cover
    pass


def image(w: int, h: int, seed: int) -> Image.Image:
    data = bytes((i * (31 + seed) + seed * 97) % 251 for i in range(w * h * 3))
    return Image.frombytes("RGB", (w, h), data)


RED, BLUE, WIDE = image(56, 56, 1), image(56, 56, 2), image(112, 56, 3)


def user(text: str, *images: Image.Image) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def media_host():
    """A local image server (127.0.0.1), which the server under test allows explicitly:
    ``/img.png`` at once, ``/drip.png`` a byte every 0.5 s."""
    host = ImageHost(base64.b64decode(png_b64(RED)), drip_interval=0.5)
    yield host
    host.close()


FETCH_TIMEOUT = 2.0  # --media-fetch-timeout of the servers here


@pytest.fixture(scope="module", params=[f[0] for f in FAMILIES] or ["none"])
def vl(request, tmp_path_factory):
    if request.param == "none":
        pytest.skip("no vision-language fixture builder")
    build = dict(FAMILIES)[request.param]
    root = tmp_path_factory.mktemp(request.param)
    model = build(root / "model")
    (root / "media").mkdir()
    proc, url = start_server(
        [
            "--model-path",
            str(root / "model"),
            "--allowed-media-domains",
            "127.0.0.1",
            "--media-fetch-timeout",
            str(FETCH_TIMEOUT),
            "--allowed-local-media-path",
            str(root / "media"),
            "--max-images-per-request",
            "3",
            "--chunked-prefill-size",
            "16",  # prompts are prefilled in several chunks, some ending inside an image
            "--max-total-tokens",
            "4096",
        ]
    )
    yield request.param, url, model, root / "model"
    stop_server(proc)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


def chat(url: str, messages: list, **kw):
    kw = {"max_tokens": 8, "temperature": 0, **kw}
    return client(url).chat.completions.create(model="m", messages=messages, **kw)


def test_greedy_output_equals_transformers(vl):
    """The server's greedy tokens for a chat with one image equal transformers' generate."""
    import torch
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    name, url, model, path = vl
    msgs = [user("What is in the picture?", WIDE)]
    tmpl = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}]
    tok = AutoTokenizer.from_pretrained(str(path))
    text = tok.apply_chat_template(tmpl, add_generation_prompt=True, tokenize=False)
    if name == "gemma3":
        proc = AutoProcessor.from_pretrained(str(path), image_seq_length=model.config.mm_tokens_per_image)
        inputs = proc(text=[text], images=[WIDE], return_tensors="pt")
    else:  # Qwen's AutoProcessor wants torchvision for video: the image processor and the tokenizer
        pixels = AutoImageProcessor.from_pretrained(str(path))(images=[WIDE], return_tensors="pt")
        n = int(pixels["image_grid_thw"].prod()) // 4  # merge 2x2
        text = text.replace("<|image_pad|>", "<|image_pad|>" * n)
        inputs = {**tok(text, return_tensors="pt", add_special_tokens=False), **pixels}
        # which tokens are the image's (transformers' M-RoPE positions read it; without it, 1-D)
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == tok.convert_tokens_to_ids("<|image_pad|>")).int()
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    want = ref[0, inputs["input_ids"].shape[1] :].tolist()
    r = chat(url, msgs, logprobs=True, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    got_text = r.choices[0].message.content
    assert r.usage.prompt_tokens == inputs["input_ids"].shape[1]  # image tokens counted
    assert got_text == tok.decode(want, skip_special_tokens=False)


def test_stream_equals_non_stream_and_usage_counts_images(vl):
    _, url, _, _ = vl
    msgs = [user("Describe.", RED)]
    full = chat(url, msgs)
    stream = client(url).chat.completions.create(
        model="m", messages=msgs, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text == full.choices[0].message.content
    text_only = chat(url, [{"role": "user", "content": "Describe."}])
    assert full.usage.prompt_tokens > text_only.usage.prompt_tokens + 3
    assert usage.prompt_tokens == full.usage.prompt_tokens
    counted = httpx.post(url + "/tokenize", json={"messages": msgs, "add_generation_prompt": True}).json()
    assert counted["count"] == full.usage.prompt_tokens


def test_output_does_not_depend_on_the_batch(vl):
    _, url, _, _ = vl
    msgs = [user("One picture.", WIDE), {"role": "assistant", "content": "ok"}, user("And two?", RED, BLUE)]
    alone = chat(url, msgs).choices[0].message.content
    others = [[user(f"other {i}", BLUE if i % 2 else RED)] for i in range(5)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(chat, url, m) for m in others] + [pool.submit(chat, url, msgs)]
        together = futs[-1].result().choices[0].message.content
        for f in futs[:-1]:
            f.result()
    assert together == alone


def test_prefix_cache_is_keyed_by_the_image(vl):
    """Same text, another image: the cache stops before the image. The same image again: it hits
    past it. A multi-turn chat re-sending its earlier image reuses that turn's K/V."""
    _, url, _, _ = vl
    first = chat(url, [user("Same words, image one.", RED)])
    other = chat(url, [user("Same words, image one.", BLUE)])
    again = chat(url, [user("Same words, image one.", RED)])
    prompt = first.usage.prompt_tokens
    assert other.usage.prompt_tokens == prompt
    # the other image's request reuses the text before the image, the same image's all of it
    assert again.usage.prompt_tokens_details.cached_tokens >= prompt - 16
    assert again.usage.prompt_tokens_details.cached_tokens - other.usage.prompt_tokens_details.cached_tokens >= 4
    turn2 = chat(
        url,
        [
            user("Same words, image one.", RED),
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And now?"},
        ],
    )
    assert turn2.usage.prompt_tokens_details.cached_tokens >= prompt - 16


def test_anthropic_responses_and_generate_take_images(vl):
    _, url, _, _ = vl
    want = chat(url, [user("Look.", RED)]).choices[0].message.content
    a = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    msg = a.messages.create(
        model="m",
        max_tokens=8,
        extra_body={"temperature": 0},
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png_b64(RED)}},
                    {"type": "text", "text": "Look."},
                ],
            }
        ],
    )
    assert msg.content[0].text == want
    r = client(url).responses.create(
        model="m",
        max_output_tokens=8,
        temperature=0,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(RED)},
                    {"type": "input_text", "text": "Look."},
                ],
            }
        ],
    )
    assert r.output_text == want
    tokens = a.messages.count_tokens(
        model="m",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png_b64(RED)}},
                    {"type": "text", "text": "Look."},
                ],
            }
        ],
    )
    assert tokens.input_tokens > 8


def test_generate_image_data(vl):
    _, url, _, _ = vl
    info = httpx.post(url + "/tokenize", json={"messages": [user("Look.", RED)], "add_generation_prompt": True})
    prompt = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "m", "messages": [user("Look.", RED)], "max_tokens": 8, "temperature": 0},
    ).json()
    rendered = httpx.post(
        url + "/tokenize",
        json={"messages": [{"role": "user", "content": "Look."}], "add_generation_prompt": True},
    ).json()
    assert info.status_code == 200 and rendered["count"] < info.json()["count"]
    # /generate with the raw prompt: the placeholder written once, the image as bare base64
    qwen = "<|vision_start|><|image_pad|><|vision_end|>"
    ph = "<start_of_image>" if vl[0] == "gemma3" else qwen
    body = {"text": f"{ph}Look.", "image_data": png_b64(RED), "sampling_params": {"max_new_tokens": 4}}
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["prompt_tokens"] > 8
    assert prompt["usage"]["prompt_tokens"] == info.json()["count"]
    bad = httpx.post(url + "/generate", json={**body, "text": "Look."}, timeout=60)
    assert bad.status_code == 400 and "once per image" in bad.json()["error"]["message"]


def test_url_policy(vl, media_host):
    _, url, _, _ = vl
    fetched = chat(
        url,
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": media_host.url + "/img.png"}},
                    {"type": "text", "text": "Look."},
                ],
            }
        ],
    )
    assert fetched.choices[0].message.content == chat(url, [user("Look.", RED)]).choices[0].message.content
    for bad in ("http://localhost:9/x.png", "http://10.0.0.1/x.png", "file:///etc/passwd", "ftp://127.0.0.1/x"):
        with pytest.raises(openai.BadRequestError) as err:
            chat(url, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": bad}}]}])
        assert err.value.body["param"] == "messages[0].content[0].image_url"


def test_bad_images_are_400_naming_the_part(vl):
    _, url, _, _ = vl
    corrupt = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnot really").decode()
    cases = [
        ([{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": corrupt}}], "content[1]"),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}], "content[0]"),
        ([{"type": "image_url", "image_url": {}}], "content[0]"),
        ([{"type": "image_url", "image_url": {"url": data_url(RED)}}] * 4, "messages"),  # over the cap of 3
    ]
    for content, where in cases:
        with pytest.raises(openai.BadRequestError) as err:
            chat(url, [{"role": "user", "content": content}])
        assert where in (err.value.body.get("param") or "") or where in err.value.body["message"]
    assert chat(url, [user("still serving", RED)]).choices[0].message.content is not None


def test_batch_lines_take_images(vl):
    _, url, _, _ = vl
    c = client(url)
    want = chat(url, [user("Look.", RED)]).choices[0].message.content
    line = {
        "custom_id": "img",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [user("Look.", RED)], "max_tokens": 8, "temperature": 0},
    }
    f = c.files.create(file=("in.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while (b := c.batches.retrieve(b.id)).status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert b.status == "completed", b
    out = json.loads(c.files.content(b.output_file_id).text.splitlines()[0])
    assert out["response"]["body"]["choices"][0]["message"]["content"] == want


# --- issue 52: fetches apart from decoding, under one deadline; file kinds --------------------


def one_family(vl) -> None:
    """Fetching and decoding are the same code for every family: checked on the first only."""
    if vl[0] != FAMILIES[0][0]:
        pytest.skip("the media pipeline is the same for every family")


def image_part(url: str) -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "x"}]}
    ]


def timed(fn, *a) -> tuple[float, object]:
    start = time.monotonic()
    try:
        out = fn(*a)
    except openai.APIError as exc:
        out = exc
    return time.monotonic() - start, out


def test_slow_urls_hit_one_deadline_and_never_delay_inline_images(vl, media_host):
    """Six URLs dripping a byte every 0.5 s (more than the 4 media threads): each is a 400 at the
    fetch deadline, and a request whose image is a data: URL, sent while they drip, takes about
    what it takes alone."""
    one_family(vl)
    _, url, _, _ = vl
    inline = [user("Look.", RED)]
    chat(url, inline)
    alone = min(timed(chat, url, inline)[0] for _ in range(3))
    seen = len(media_host.hosts)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        drips = [pool.submit(timed, chat, url, image_part(media_host.url + "/drip.png")) for _ in range(6)]
        deadline = time.monotonic() + 30
        while len(media_host.hosts) < seen + 6 and time.monotonic() < deadline:
            time.sleep(0.02)  # until all six are being fetched
        assert len(media_host.hosts) >= seen + 6
        during, r = timed(chat, url, inline)
        assert not isinstance(r, Exception), r
        results = [f.result() for f in drips]
    for elapsed, err in results:
        assert isinstance(err, openai.BadRequestError), err
        assert f"longer than {FETCH_TIMEOUT:g} s" in err.body["message"]
        assert elapsed / FETCH_TIMEOUT < 3
    assert during < max(5 * alone, FETCH_TIMEOUT / 2), (during, alone)


def test_a_fifo_under_the_allowed_path_is_a_400_at_once(vl):
    one_family(vl)
    _, url, _, path = vl
    fifo = path.parent / "media" / "pipe.png"
    if not fifo.exists():
        os.mkfifo(fifo)  # no writer: opening it to read would wait for ever
    elapsed, err = timed(chat, url, image_part(f"file://{fifo}"))
    assert isinstance(err, openai.BadRequestError) and "no regular file" in err.body["message"], err
    assert elapsed < FETCH_TIMEOUT
    assert chat(url, [user("still serving", RED)]).choices[0].message.content is not None


def test_an_image_over_the_default_pixel_cap_is_a_400_before_decoding(vl):
    """6300 x 6300 of one colour is a few KB of PNG; the default cap (twice the model's most
    pixels, at least 16 Mi) refuses it from its header, at once."""
    one_family(vl)
    _, url, _, _ = vl
    huge = Image.new("RGB", (6300, 6300), (9, 9, 9))
    elapsed, err = timed(chat, url, image_part(data_url(huge)))
    assert isinstance(err, openai.BadRequestError), err
    assert "6300x6300: more than 16777216 pixels" in err.body["message"]
    assert err.body["param"] == "messages[0].content[0].image_url"
    assert elapsed < 5  # decoding it whole takes seconds and 160 MB
