"""Response shapes and streaming contract of chat and completions (reference §2), against the
real server and model through the official client."""

from __future__ import annotations

import json

import httpx
import pytest

MSG = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def client(server):
    return server.client


def test_chat_stream_equals_non_stream(client):
    full = client.chat.completions.create(model="m", messages=MSG, temperature=0, max_tokens=40)
    chunks = list(
        client.chat.completions.create(
            model="m", messages=MSG, temperature=0, max_tokens=40, stream=True, stream_options={"include_usage": True}
        )
    )
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and finishes[0].finish_reason == full.choices[0].finish_reason
    assert finishes[0].delta.content in (None, "")  # the finish chunk has an empty delta
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_chat_stream_deltas_carry_reasoning_content(client):
    """SGLang clients read chunk.choices[0].delta.reasoning_content on every chunk (the role and
    finish chunks too): it is null when there is no reasoning, never missing."""
    chunks = [
        c for c in client.chat.completions.create(model="m", messages=MSG, max_tokens=8, stream=True) if c.choices
    ]
    assert len(chunks) >= 3 and chunks[-1].choices[0].finish_reason
    assert [c.choices[0].delta.reasoning_content for c in chunks] == [None] * len(chunks)


def test_completion_stream_equals_non_stream(client):
    kw = dict(model="m", prompt="The three primary colors are", temperature=0, max_tokens=30)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_n_choices_stream_has_one_finish_per_index(client):
    chunks = list(
        client.chat.completions.create(
            model="m", messages=MSG, max_tokens=12, n=3, seed=7, stream=True, stream_options={"include_usage": True}
        )
    )
    finishes = {}
    roles = set()
    for c in chunks:
        for ch in c.choices:
            if ch.delta.role == "assistant":
                roles.add(ch.index)
            if ch.finish_reason:
                assert ch.index not in finishes, "duplicate finish chunk"
                finishes[ch.index] = ch.finish_reason
    assert roles == {0, 1, 2} and set(finishes) == {0, 1, 2}
    usage = chunks[-1].usage
    assert usage.completion_tokens <= 36 and usage.prompt_tokens > 0


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model="m", messages=MSG, max_tokens=5, logprobs=True, top_logprobs=5, n=2, temperature=0
    )
    assert len(r.choices) == 2
    for ch in r.choices:
        content = ch.logprobs.content
        assert len(content) == r.usage.completion_tokens // 2 or len(content) <= 5
        for entry in content:
            assert len(entry.top_logprobs) == 5
            assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
            # greedy: the chosen token is the most likely one
            assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)


@pytest.mark.parametrize("echo", [False, True])
@pytest.mark.parametrize("logprobs", [None, 3])
@pytest.mark.parametrize("token_ids", [False, True])
def test_completion_grid(client, server, echo, logprobs, token_ids):
    prompts = ["Hello, my name is", "The sky is"]
    tok_prompts = [[t for t in _tokenize(server, p)] for p in prompts]
    r = client.completions.create(
        model="m",
        prompt=tok_prompts if token_ids else prompts,
        max_tokens=4,
        n=2,
        echo=echo,
        logprobs=logprobs,
        temperature=0,
    )
    assert len(r.choices) == 4
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    exact = sum(len(t) for t in tok_prompts)
    assert r.usage.prompt_tokens == exact
    for c in r.choices:
        prompt = prompts[c.index // 2]
        if echo:
            assert c.text.startswith(prompt)
        if logprobs:
            lp = c.logprobs
            assert isinstance(lp.tokens[0], str)
            assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset)
            assert lp.top_logprobs[1]
            if echo:
                assert lp.token_logprobs[0] is None
            else:
                assert lp.token_logprobs[0] is not None


CHAT_PROMPT = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"


def test_completion_stream_logprobs_finish_lists_tokens(client):
    """SGLang's test_completion_stream reads logprobs.tokens[0] on every chunk: a finish after the
    (left out) stop token must not bring a chunk whose logprobs list nothing."""
    kw = dict(model="m", prompt=CHAT_PROMPT, temperature=0, max_tokens=60, logprobs=2)
    full = client.completions.create(**kw)
    assert full.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**kw, stream=True))
    tokens = []
    for c in chunks:
        lp = c.choices[0].logprobs
        assert lp is not None and lp.tokens and isinstance(lp.top_logprobs[0], dict), c
        tokens += lp.tokens
    assert tokens == full.choices[0].logprobs.tokens
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1
    assert chunks[-1].choices[0].matched_stop == full.choices[0].matched_stop


def _tokenize(server, text):
    from transformers import AutoTokenizer

    from llmkit.core.model.loader.source import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))
    return tok(text, add_special_tokens=False)["input_ids"]


def test_matched_stop_string_and_length(client):
    r = client.completions.create(model="m", prompt="Count: 1, 2, 3, 4,", max_tokens=30, temperature=0, stop=[" 6"])
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.matched_stop == " 6" and " 6" not in c.text
    r = client.completions.create(model="m", prompt="Count: 1, 2, 3, 4,", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.choices[0].matched_stop is None


def test_stop_string_never_leaks_when_streaming(client):
    kw = dict(model="m", prompt="Count: 1, 2, 3, 4,", max_tokens=30, temperature=0, stop=[", 7", " 6,"])
    full = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert streamed == full and " 6," not in streamed


def test_eos_matched_stop_is_token_id(client):
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Say hi."}], temperature=0, max_tokens=200
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].matched_stop == 2


def test_ignore_eos_and_min_tokens(client):
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Say hi."}],
        temperature=0,
        max_tokens=40,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 40
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Say hi."}],
        temperature=0,
        max_tokens=40,
        extra_body={"min_tokens": 25},
    )
    assert r.usage.completion_tokens >= 25


def test_continue_final_message(client):
    r = client.chat.completions.create(
        model="m",
        temperature=0,
        max_tokens=10,
        messages=[
            {"role": "user", "content": "Give me a JSON object describing a product."},
            {"role": "assistant", "content": '{\n  "name": "'},
        ],
        extra_body={"continue_final_message": True},
    )
    assert r.choices[0].message.content  # continues the prefilled text, no new turn


def test_models_endpoints(client, server):
    models = client.models.list().data
    assert len(models) == 1 and isinstance(models[0].model_extra["max_model_len"], int)
    card = client.models.retrieve(models[0].id)
    assert card.id == models[0].id
    import openai

    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_health_endpoints(server):
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/health_generate", timeout=60).status_code == 200


def test_logit_bias_forces_token(client):
    r = client.completions.create(model="m", prompt="Hello", max_tokens=3, temperature=0, logit_bias={"42": 100})
    assert r.usage.completion_tokens == 3


def test_raw_sse_format(server):
    body = {"model": "m", "messages": MSG, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        assert e.startswith("data: ")
        json.loads(e[6:])
