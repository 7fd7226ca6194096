"""Tool-call parsers: real formats, stream vs non-stream, invalid blocks, linear time."""

from __future__ import annotations

import json
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmkit.core.parsing.reasoning import create_reasoning_parser
from llmkit.core.parsing.tool_parser import ToolCallDelta, create_tool_parser, new_call_id
from llmkit.core.plugins import PluginError, registry


def tool(name):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


TOOLS = [tool("get_weather"), tool("add")]


def stream(name, chunks, tools=TOOLS):
    """Feed chunks; return (content, [(name, args)], deltas, parser)."""
    p = create_tool_parser(name, tools=tools)
    content, deltas = "", []
    for ch in [*chunks, None]:
        d = p.feed(ch) if ch is not None else p.finish()
        content += d.content
        deltas += d.calls
    return content, [(c.name, c.arguments) for c in p.calls], deltas, p


def whole(name, text, tools=TOOLS):
    content, calls = create_tool_parser(name, tools=tools).parse(text)
    return content, [(c.name, c.arguments) for c in calls]


def check_deltas(deltas, calls):
    """Name first (with an id), then fragments whose join equals the final arguments."""
    seen: dict[int, str] = {}
    for d in deltas:
        if d.index not in seen:
            assert d.id is not None and d.name is not None and d.arguments == ""
            seen[d.index] = ""
        else:
            assert d.id is None and d.name is None
            seen[d.index] += d.arguments
    assert [seen[i] for i in sorted(seen)] == [a for _, a in calls]


WEATHER = {"city": "Paris", "note": 'a } and " in a string'}
CASES = {
    "hermes": (
        "Let me check 天气 🌦.\n<tool_call>\n"
        + json.dumps({"name": "get_weather", "arguments": WEATHER}, ensure_ascii=False)
        + '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}\n</tool_call>',
        "Let me check 天气 🌦.",
    ),
    "llama3": (
        '{"name": "get_weather", "parameters": '
        + json.dumps(WEATHER)
        + '}; {"name": "add", "parameters": {"a": 1, "b": [2, 3]}}',
        "",
    ),
    "mistral": (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": '
        + json.dumps(WEATHER)
        + '}, {"name": "add", "arguments": {"a": 1, "b": [2, 3]}}]',
        "",
    ),
    "deepseekv3": (
        "好的<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        + json.dumps(WEATHER)
        + "\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n"
        '{"a": 1, "b": [2, 3]}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "好的",
    ),
    "kimi_k2": (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        + json.dumps(WEATHER)
        + '<|tool_call_end|><|tool_call_begin|>functions.add:1<|tool_call_argument_begin|>{"a": 1, "b": [2, 3]}'
        "<|tool_call_end|><|tool_calls_section_end|>",
        "",
    ),
    "pythonic": (
        '[get_weather(city="Paris", note=\'a } and " in a string\'), add(a=1, b=[2, 3])]',
        "",
    ),
    "qwen3_coder": (
        "Checking 天气 🌦.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        '<parameter=note>\na } and " in a string\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n'
        "<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n[2, 3]\n</parameter>\n</function>\n</tool_call>",
        "Checking 天气 🌦.",
    ),
    "gpt-oss": (
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        + json.dumps(WEATHER)
        + "<|call|><|start|>assistant to=functions.add<|channel|>commentary json<|message|>"
        '{"a": 1, "b": [2, 3]}<|call|>',
        "",
    ),
}


def test_all_parsers_registered():
    assert set(registry().names("tool_parser")) >= {
        "hermes",
        "llama3",
        "mistral",
        "deepseekv3",
        "kimi_k2",
        "pythonic",
        "gpt-oss",
        "qwen3_coder",
    }
    with pytest.raises(PluginError, match="hermes"):
        create_tool_parser("nope")


def test_call_ids_and_delta_shape():
    assert re.fullmatch(r"call_[0-9a-f]{24}", new_call_id())
    d = ToolCallDelta(0, "call_x", "f", "")
    assert d.to_openai() == {
        "index": 0,
        "id": "call_x",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("split", [None, 1, 7])
def test_real_formats(name, split):
    text, content = CASES[name]
    chunks = [text] if split is None else [text[i : i + split] for i in range(0, len(text), split)]
    got_content, calls, deltas, p = stream(name, chunks)
    assert got_content == content
    assert [n for n, _ in calls] == ["get_weather", "add"]
    assert json.loads(calls[0][1]) == WEATHER
    assert json.loads(calls[1][1]) == {"a": 1, "b": [2, 3]}
    check_deltas(deltas, calls)
    assert (got_content, calls) == whole(name, text)
    ids = [c.id for c in p.calls]
    if name == "kimi_k2":
        assert ids == ["functions.get_weather:0", "functions.add:1"]
    else:
        assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


@pytest.mark.parametrize(
    "name,text",
    [
        ("hermes", "<tool_call>\nget_weather(city='x')\n</tool_call>"),
        ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'),
        ("hermes", '<tool_call>{"name": 1'),
        ("llama3", '{"answer": 42}'),
        ("llama3", "<|python_tag|>import os"),
        ("mistral", "[TOOL_CALLS] oops not json"),
        (
            "deepseekv3",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\nnot json",
        ),
        ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0 junk"),
        ("pythonic", "[1, 2, 3]"),
        ("pythonic", "[get_weather(x)]"),
        ("gpt-oss", "<|channel|>commentary to=functions.get_weather<|message|>not json<|call|>"),
        ("qwen3_coder", "<tool_call>\n<function=rm_rf>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"),
        ("qwen3_coder", "<tool_call>\nno function here\n</tool_call>"),
        ("qwen3_coder", "<tool_call>\n<function=get_wea"),
    ],
)
def test_invalid_blocks_stay_content(name, text):
    for chunks in ([text], list(text)):
        content, calls, _, _ = stream(name, chunks)
        assert calls == [] and content == text.strip()


def test_plain_text_passes_through():
    for name in CASES:
        text = "Hello 世界 👋 — no calls; a {json} [list] <tag> here."
        assert whole(name, text) == (text, []), name


def test_truncated_call_keeps_partial_arguments():
    content, calls = whole("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1')
    assert content == "" and calls == [("add", '{"a": 1')]


def test_arguments_before_name_and_no_arguments():
    assert whole("hermes", '<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>') == (
        "",
        [("add", '{"a": 1}')],
    )
    assert whole("hermes", '<tool_call>{"name": "add"}</tool_call>') == ("", [("add", "{}")])


def test_no_tools_means_any_name():
    assert whole("hermes", '<tool_call>{"name": "x", "arguments": {}}</tool_call>', tools=[]) == (
        "",
        [("x", "{}")],
    )


def test_deepseek_v31_and_mistral_v11_forms():
    v31 = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 2}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    assert whole("deepseekv3", v31) == ("", [("add", '{"a": 2}')])
    assert whole("mistral", 'Sure.[TOOL_CALLS]add[ARGS]{"a": 2}') == (
        "Sure.",
        [("add", '{"a": 2}')],
    )
    assert whole("json_array", '[{"name": "add", "parameters": {"a": 2}}]') == (
        "",
        [("add", '{"a": 2}')],
    )


def test_gpt_oss_after_reasoning_parser():
    text = (
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city":"SF"}<|call|>'
    )
    rp = create_reasoning_parser("gpt-oss", prompt_text="<|start|>assistant")
    tp = create_tool_parser("gpt-oss", tools=TOOLS)
    content = ""
    for ch in text:
        _, c = rp.feed(ch)
        content += tp.feed(c).content
    content += tp.feed(rp.finish("stop")[1]).content + tp.finish().content
    assert content == "" and [(c.name, c.arguments) for c in tp.calls] == [("get_weather", '{"city":"SF"}')]


@settings(max_examples=80, deadline=None)
@given(
    name=st.sampled_from(sorted(CASES)),
    cuts=st.lists(st.integers(min_value=0, max_value=600), max_size=15),
)
def test_streaming_equals_non_streaming(name, cuts):
    text = CASES[name][0]
    points = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    content, calls, deltas, _ = stream(name, chunks)
    assert (content, calls) == whole(name, text)
    check_deltas(deltas, calls)


@pytest.mark.parametrize("name", sorted(CASES))
def test_linear_time_on_adversarial_text(name):
    unit = "<tool_ca<|python_t[TOOL_CA<｜tool▁call<|tool_calls_sec<|chan[get(" + "y" * 6
    text = unit * (1_000_000 // len(unit))
    start = time.perf_counter()
    content, calls = whole(name, text)
    streamed = stream(name, [text[i : i + 997] for i in range(0, len(text), 997)])
    elapsed = time.perf_counter() - start
    assert (streamed[0], streamed[1]) == (content, calls)
    assert calls == [] and len(content) > 900_000
    assert elapsed < 1.0, elapsed


@pytest.mark.parametrize("name", ["hermes", "gpt-oss", "kimi_k2"])
def test_linear_time_on_huge_arguments(name):
    args = json.dumps({"data": 'x\\"{' * 100_000, "list": list(range(20_000))})
    text = {
        "hermes": '<tool_call>{"name": "add", "arguments": ' + args + "}</tool_call>",
        "gpt-oss": "<|channel|>commentary to=functions.add<|message|>" + args + "<|call|>",
        "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>"
        + args
        + "<|tool_call_end|><|tool_calls_section_end|>",
    }[name]
    start = time.perf_counter()
    streamed = stream(name, [text[i : i + 101] for i in range(0, len(text), 101)])
    assert time.perf_counter() - start < 1.0
    assert streamed[1] == [("add", args)]


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<|python_tag|>",
    "[TOOL_CALLS]",
    "[ARGS]",
    '{"name": "add"',
    ', "arguments": ',
    '{"a": 1}',
    "}",
    "{",
    "[",
    "]",
    ";",
    ",",
    '"',
    "\\",
    "add(",
    "a=1",
    ")",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "```json\n",
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "functions.add:0",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|channel|>",
    "commentary to=functions.add",
    "<|message|>",
    "<|call|>",
    "<function=add>",
    "<function=",
    "<parameter=a>",
    "</parameter>",
    "</function>",
    " ",
    "\n",
    "答",
    "🙂",
    "x",
]


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from([*sorted(CASES), "json_array"]),
    parts=st.lists(st.sampled_from(FRAGMENTS), max_size=25),
    cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=10),
)
def test_fuzz_streaming_equals_non_streaming(name, parts, cuts):
    text = "".join(parts)
    points = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    content, calls, deltas, _ = stream(name, chunks)
    assert (content, calls) == whole(name, text)
    check_deltas(deltas, calls)


def pipeline(reasoning, tools, chunks, prompt=""):
    """Reasoning parser then tool parser, as the server chains them."""
    rp = create_reasoning_parser(reasoning, prompt_text=prompt)
    tp = create_tool_parser(tools, tools=TOOLS)
    r = content = ""
    for ch in [*chunks, None]:
        dr, dc = rp.feed(ch) if ch is not None else rp.finish("stop")
        r += dr
        content += tp.feed(dc).content
    content += tp.finish().content
    return r, content, [(c.name, c.arguments) for c in tp.calls]


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'


@pytest.mark.parametrize("split", [None, 1])
def test_end_tag_and_tool_call_in_one_delta(split):
    text = "<think>Use the tool.</think>" + CALL
    chunks = [text] if split is None else list(text)
    assert pipeline("qwen3", "hermes", chunks) == ("Use the tool.", "", [("add", '{"a": 1}')])


def test_tool_call_ends_unclosed_reasoning():
    prompt = "<|im_start|>assistant\n<think>\n"
    assert pipeline("qwen3", "hermes", [CALL], prompt) == ("", "", [("add", '{"a": 1}')])
    assert pipeline("qwen3-thinking", "hermes", ["Hmm.\n" + CALL]) == (
        "Hmm.",
        "",
        [("add", '{"a": 1}')],
    )
