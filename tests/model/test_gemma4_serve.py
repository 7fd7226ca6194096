"""A tiny Gemma 4 (every feature of the family at once) served by a real ``llmkit serve`` and driven
by the ``openai`` client: greedy chat output equals transformers' ``generate`` on the templated
prompt, streaming equals non-streaming, an audio part is a 400 naming it, and ``/metrics`` reports
the window layers' own pages."""

from __future__ import annotations

import gemma4_utils as g4
import openai
import pytest
import torch

from server_utils import start_server, stop_server

MESSAGES = [{"role": "user", "content": "Say something long enough to pass the sliding window of eight tokens."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma4")
    ref = g4.save_tiny_gemma4_text(path, "all")
    proc, url = start_server(["--model-path", str(path), "--page-size", "4", "--chunked-prefill-size", "16"])
    try:
        yield ref, path, openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120), url
    finally:
        stop_server(proc)


def test_greedy_chat_equals_generate_and_stream_equals_non_stream(served):
    from transformers import AutoTokenizer

    ref, path, client, _ = served
    tok = AutoTokenizer.from_pretrained(str(path))
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    assert len(ids) > 2 * g4.WINDOW
    kw = dict(model="m", messages=MESSAGES, temperature=0, max_tokens=10, extra_body={"min_tokens": 10})
    r = client.chat.completions.create(**kw)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 10
    with torch.no_grad():
        gen = ref.generate(torch.tensor([ids]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert r.choices[0].message.content == tok.decode(gen[0, len(ids) :], skip_special_tokens=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw))
    assert streamed == r.choices[0].message.content


def test_an_audio_part_is_refused_with_a_400(served):
    _, _, client, _ = served
    content = [
        {"type": "text", "text": "what is said here?"},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    ]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}], max_tokens=4)
    assert "input_audio" in str(err.value) and "content[1]" in str(err.value)


def test_metrics_report_the_window_pages(served):
    import httpx

    url = served[3]
    served[2].completions.create(model="m", prompt="a prompt past the window " * 3, max_tokens=4)
    metrics = httpx.get(url + "/metrics", timeout=30).text
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("llmkit:kv_window_pages_")
    }
    assert values["llmkit:kv_window_pages_total"] > 0
    assert values["llmkit:kv_window_pages_in_use"] == 0  # idle
    assert values["llmkit:kv_window_pages_cached"] > 0  # the finished request's window, for its next turn
