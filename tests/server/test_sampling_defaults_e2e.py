"""The model's generation_config.json on a real server, on every generating route (issue 48).

The model is a tiny random-weight one (byte-level tokenizer, milliseconds a token), whose
distributions are flat: sampled at temperature 1 with top_p 1 its output is never the greedy
one, so which defaults a request got shows in its text. Its generation_config.json says
temperature 0 and top_p 1e-6, each of which alone makes decoding greedy:

* both left out: greedy (the file applies);
* temperature 1 sent, top_p left out: still greedy (the file's top_p applies);
* top_p 1 sent, temperature left out: still greedy (the file's temperature applies);
* both sent as 1: sampled (a request's values win);
* under ``--generation-config vllm``, both left out: sampled (the file is ignored).

One server per configuration, each request a few tokens.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from model_utils import tiny_model_dir
from server_utils import start_server, stop_server

FILE = {"temperature": 0.0, "top_p": 1e-6}
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPT = "Hello there"
N = 4  # tokens per answer
TRIES = 2  # sampled answers: one of them differs from the greedy one (each always has, here)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen-config-model")
    tiny_model_dir(d, "llama")
    (d / "generation_config.json").write_text(json.dumps({**FILE, "eos_token_id": 0, "do_sample": True}))
    (d / "chat.jinja").write_text(TEMPLATE)
    return d


def _serve(model_dir, *extra):
    args = ["--model-path", str(model_dir), "--chat-template", str(model_dir / "chat.jinja")]
    proc, url = start_server([*args, "--batch-storage", "none", "--disable-web-ui", *extra])
    return proc, url


@pytest.fixture(scope="module")
def auto(model_dir):
    proc, url = _serve(model_dir)  # --generation-config auto: the default
    try:
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def vllm(model_dir):
    proc, url = _serve(model_dir, "--generation-config", "vllm")
    try:
        yield url
    finally:
        stop_server(proc)


class Route:
    """One API's request with the sampling fields given (None: left out), its text."""

    def __init__(self, url: str) -> None:
        self.oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        self.anthropic = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)
        self.http = httpx.Client(base_url=url, timeout=120)

    def ask(self, route: str, seed: int = 0, **sampling) -> str:
        sampling = {k: v for k, v in sampling.items() if v is not None}
        if route == "chat":
            msgs = [{"role": "user", "content": PROMPT}]
            r = self.oai.chat.completions.create(model="m", messages=msgs, max_tokens=N, seed=seed, **sampling)
            return r.choices[0].message.content
        if route == "completions":
            r = self.oai.completions.create(model="m", prompt=PROMPT, max_tokens=N, seed=seed, **sampling)
            return r.choices[0].text
        if route == "responses":  # no seed in the Responses API: each sampled answer is a fresh draw
            r = self.oai.responses.create(model="m", input=PROMPT, max_output_tokens=N, store=False, **sampling)
            return r.output_text
        if route == "anthropic":  # this SDK version has no sampling arguments: they go in the body
            msgs = [{"role": "user", "content": PROMPT}]
            r = self.anthropic.messages.create(model="m", max_tokens=N, messages=msgs, extra_body=sampling)
            return "".join(b.text for b in r.content if b.type == "text")
        assert route == "generate"
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": N, "sampling_seed": seed, **sampling}}
        r = self.http.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()["text"]

    def sampled(self, route: str, **sampling) -> list[str]:
        return [self.ask(route, seed=s, **sampling) for s in range(TRIES)]


ROUTES = ["chat", "completions", "responses", "anthropic", "generate"]


@pytest.mark.parametrize("route", ROUTES)
def test_the_file_applies_where_a_field_is_left_out(auto, route):
    api = Route(auto)
    greedy = api.ask(route, temperature=0)
    assert greedy, "the greedy answer is some text"
    assert api.sampled(route) == [greedy] * TRIES  # both from the file
    assert api.sampled(route, temperature=1.0) == [greedy] * TRIES  # the file's top_p
    assert api.sampled(route, top_p=1.0) == [greedy] * TRIES  # the file's temperature
    assert api.sampled(route, temperature=1.0, top_p=1.0) != [greedy] * TRIES  # a request's values win


@pytest.mark.parametrize("route", ROUTES)
def test_generation_config_vllm_ignores_the_file(vllm, route):
    api = Route(vllm)
    greedy = api.ask(route, temperature=0)
    assert api.sampled(route) != [greedy] * TRIES  # temperature 1, top_p 1: the neutral values


def test_responses_report_the_values_they_sample_with(auto, vllm):
    for url, want in ((auto, (0.0, 1e-6)), (vllm, (1.0, 1.0))):
        r = Route(url).oai.responses.create(model="m", input=PROMPT, max_output_tokens=1, store=False)
        assert (r.temperature, r.top_p) == want
    r = Route(auto).oai.responses.create(model="m", input=PROMPT, max_output_tokens=1, store=False, top_p=0.5)
    assert (r.temperature, r.top_p) == (0.0, 0.5)


def test_server_info_shows_the_defaults(auto, vllm):
    neutral = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    assert httpx.get(auto + "/get_server_info", timeout=30).json()["sampling_defaults"] == {**neutral, **FILE}
    assert httpx.get(vllm + "/get_server_info", timeout=30).json()["sampling_defaults"] == neutral
