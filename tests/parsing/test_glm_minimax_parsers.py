"""The ``glm45`` and ``minimax_m2`` tool and reasoning parsers on outputs written in the formats
their model cards and chat templates document: several calls, nested JSON and escaped quotes in
values, schema typing, text around the calls, a block naming no tool, output cut off inside a
call; the stream split at every point (and char by char) gives what the whole text gives."""

from __future__ import annotations

import json

import pytest

from llmkit.core.parsing.reasoning import create_reasoning_parser
from llmkit.core.parsing.tool_parser import create_tool_parser


def tool(name, **props):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}


TOOLS = [
    tool("get_weather", city={"type": "string"}, days={"type": "integer"}, metric={"type": "boolean"}),
    tool("search", query={"type": "object"}, note={"type": "string"}, tags={"type": "array"}),
    tool("get_time"),
]
NESTED = {"q": 'say "hi"', "filters": {"lang": ["en", "fr"], "deep": {"x": None, "y": 1.5}}}

# GLM-4.5's documented format (newlines), then GLM-4.7's (none), with reasoning in front
GLM45 = (
    "<think>Paris first, then a search.</think>\nI'll check the weather and search.\n"
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>metric</arg_key>\n<arg_value>true</arg_value>\n"
    "</tool_call>\n"
    "<tool_call>search<arg_key>query</arg_key><arg_value>" + json.dumps(NESTED) + "</arg_value>"
    '<arg_key>note</arg_key><arg_value>quote: "x" </arg_value><arg_key>tags</arg_key><arg_value>["a", "b"]</arg_value>'
    "</tool_call>"
)
GLM45_CALLS = [
    ("get_weather", {"city": "Paris", "days": 3, "metric": True}),
    ("search", {"query": NESTED, "note": 'quote: "x" ', "tags": ["a", "b"]}),
]
MINIMAX = (
    "<think>\nTwo tools are needed.\n</think>\n\nLet me look.\n<minimax:tool_call>\n"
    '<invoke name="get_weather">\n<parameter name="city">New "York"</parameter>\n'
    '<parameter name="days">7</parameter>\n</invoke>\n'
    '<invoke name="search">\n<parameter name="query">' + json.dumps(NESTED) + "</parameter>\n"
    '<parameter name="note">\nline one\nline two\n</parameter>\n</invoke>\n'
    '<invoke name="get_time">\n</invoke>\n</minimax:tool_call>'
)
MINIMAX_CALLS = [
    ("get_weather", {"city": 'New "York"', "days": 7}),
    ("search", {"query": NESTED, "note": "line one\nline two"}),
    ("get_time", {}),
]


def run(parser: str, chunks: list[str], tools=TOOLS, prompt: str = "", kwargs=None):
    """The server's order: the reasoning parser, then its content through the tool parser.
    Returns (reasoning, content, [(name, arguments dict)])."""
    r = create_reasoning_parser(parser, prompt_text=prompt, chat_template_kwargs=kwargs, stream_reasoning=True)
    t = create_tool_parser(parser, tools=tools)
    reasoning, content = "", ""
    for ch in [*chunks, None]:
        rd, cd = r.feed(ch) if ch is not None else r.finish("stop")
        reasoning += rd
        d = t.feed(cd) if cd else None
        content += d.content if d else ""
        if ch is None:
            content += t.finish().content
    return reasoning, content, [(c.name, json.loads(c.arguments)) for c in t.calls]


def splits(text: str):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


@pytest.mark.parametrize(
    ("parser", "text", "reasoning", "content", "calls"),
    [
        ("glm45", GLM45, "Paris first, then a search.", "I'll check the weather and search.", GLM45_CALLS),
        ("minimax_m2", MINIMAX, "Two tools are needed.", "Let me look.", MINIMAX_CALLS),
    ],
)
def test_recorded_turn_at_every_split(parser, text, reasoning, content, calls):
    for chunks in splits(text):
        assert run(parser, chunks) == (reasoning, content, calls), chunks[:2]


def test_glm47_prefilled_think_and_thinking_off():
    """GLM-4.7's template ends the prompt with ``<think>``; with thinking off it closes an empty block."""
    out = "plan it</think>Sure.<tool_call>get_time</tool_call>"
    assert run("glm45", [out], prompt="<|assistant|><think>") == ("plan it", "Sure.", [("get_time", {})])
    off = run("glm45", ["Hi <think>x</think>"], prompt="<|assistant|></think>", kwargs={"enable_thinking": False})
    assert off == ("", "Hi <think>x</think>", [])


def test_a_tool_call_inside_reasoning_ends_it():
    for parser, out in (
        ("glm45", "<think>I should call<tool_call>get_time</tool_call>"),
        ("minimax_m2", '<think>I should call<minimax:tool_call><invoke name="get_time"></invoke></minimax:tool_call>'),
    ):
        for chunks in splits(out):
            assert run(parser, chunks) == ("I should call", "", [("get_time", {})])


@pytest.mark.parametrize("parser", ["glm45", "minimax_m2"])
def test_unknown_tool_stays_content(parser):
    text = (
        "<tool_call>rm_rf<arg_key>p</arg_key><arg_value>/</arg_value></tool_call>"
        if parser == "glm45"
        else '<minimax:tool_call><invoke name="rm_rf"></invoke></minimax:tool_call>'
    )
    t = create_tool_parser(parser, tools=TOOLS)
    assert t.parse(text) == (text, [])


def test_cut_off_calls_keep_what_was_closed():
    glm = (
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>\n<arg_va"
    )
    mm = '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Oslo</parameter>\n<parameter na'
    for parser, text in (("glm45", glm), ("minimax_m2", mm)):
        for chunks in splits(text):
            t = create_tool_parser(parser, tools=TOOLS)
            content = "".join(t.feed(c).content for c in chunks) + t.finish().content
            assert content == "" and [(c.name, json.loads(c.arguments)) for c in t.calls] == [
                ("get_weather", {"city": "Oslo"})
            ]


def test_undeclared_values_read_as_json_where_they_parse():
    t = create_tool_parser("glm45", tools=[])  # no schema: any name, values JSON where they parse
    text = "<tool_call>f<arg_key>n</arg_key><arg_value>42</arg_value><arg_key>s</arg_key><arg_value>hi</arg_value></tool_call>"
    _, calls = t.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"n": 42, "s": "hi"})]
