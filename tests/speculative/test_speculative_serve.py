"""Everything the API offers works the same under ``--speculative-algorithm NGRAM``, chains and trees
(``--speculative-eagle-topk 3``): a server with speculation answers exactly what the default server answers (greedy and seeded), streamed or not,
with stop strings inside accepted runs, max_tokens, logprobs, n > 1, a regex constraint, the
Responses and Anthropic routes; and it reports its acceptance in /metrics and the decode log."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from server_utils import server_log, start_server, stop_server

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"
COPY = [{"role": "user", "content": f"Repeat this code exactly:\n{CODE}"}]
CHAT = [{"role": "user", "content": "Name three colors."}]


TREE = ["--speculative-eagle-topk", "3", "--speculative-ngram-min-match-window-size", "1"]


@pytest.fixture(scope="module", params=[[], TREE], ids=["chain", "tree"])
def spec(request):
    proc, url = start_server(
        ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5", *request.param]
    )
    try:
        yield proc, url, openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    finally:
        stop_server(proc)


def _chat(client, messages, **kw):
    return client.chat.completions.create(model="m", messages=messages, **{"max_tokens": 48, "temperature": 0, **kw})


def _streamed(client, messages, **kw):
    parts = [c.choices[0].delta.content or "" for c in _chat(client, messages, stream=True, **kw) if c.choices]
    return "".join(parts)


@pytest.mark.parametrize("kw", [{}, {"temperature": 0.9, "seed": 5}, {"stop": ["a * b"]}, {"max_tokens": 17}])
def test_same_answers_as_without_speculation(spec, server, kw):
    _, _, client = spec
    for messages in (COPY, CHAT) if len(kw) != 1 else (COPY,):  # plain chat: greedy and seeded
        want, got = _chat(server.client, messages, **kw), _chat(client, messages, **kw)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.choices[0].finish_reason == want.choices[0].finish_reason
        assert got.usage.completion_tokens == want.usage.completion_tokens
        assert _streamed(client, messages, **kw) == want.choices[0].message.content
        if messages is COPY and "stop" in kw:  # the stop string lies inside the copied run
            assert "a * b" not in got.choices[0].message.content and got.choices[0].finish_reason == "stop"
        if messages is COPY and "max_tokens" in kw:
            assert got.usage.completion_tokens == 17 and got.choices[0].finish_reason == "length"


def test_logprobs_n_and_a_regex(spec, server):
    _, _, client = spec
    got = _chat(client, COPY, logprobs=True, top_logprobs=2, n=2, temperature=0.7, seed=3)
    want = _chat(server.client, COPY, logprobs=True, top_logprobs=2, n=2, temperature=0.7, seed=3)
    for g, w in zip(got.choices, want.choices):
        assert g.message.content == w.message.content
        assert [t.token for t in g.logprobs.content] == [t.token for t in w.logprobs.content]
        assert all(len(t.top_logprobs) == 2 for t in g.logprobs.content)
    pattern = r"def (add|sub)\(a, b\):\n    return a [+-] b\n"
    got = _chat(client, COPY, extra_body={"regex": pattern})
    assert (
        got.choices[0].message.content
        == _chat(server.client, COPY, extra_body={"regex": pattern}).choices[0].message.content
    )


def test_responses_and_anthropic_routes(spec, server):
    _, url, client = spec
    kw = {"model": "m", "input": COPY[0]["content"], "max_output_tokens": 40, "temperature": 0}
    assert client.responses.create(**kw).output_text == server.client.responses.create(**kw).output_text
    mk = {"model": "m", "max_tokens": 40, "messages": COPY, "extra_body": {"temperature": 0}}
    ours = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0).messages.create(**mk)
    ref = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0).messages.create(**mk)
    assert ours.content[0].text == ref.content[0].text


def test_acceptance_in_metrics_and_the_decode_log(spec):
    proc, url, client = spec
    _chat(client, COPY, max_tokens=80)
    text = httpx.get(url + "/metrics", timeout=30).text
    accepted = [ln for ln in text.splitlines() if ln.startswith("llmkit:spec_decode_num_accepted_tokens")]
    length = [ln for ln in text.splitlines() if ln.startswith("llmkit:spec_accept_length")]
    assert accepted and float(accepted[0].split()[-1]) > 0, text
    assert length and float(length[0].split()[-1]) > 1.0
    assert "accept len: " in server_log(proc)
