"""qwen3_coder tool calls (Qwen3-Coder, Qwen3.5, Qwen3.6): typed parameters, malformed output,
streaming equal to non-streaming, and the Qwen3.5 reasoning parser in front of it."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmkit.core.parsing.arg_types import convert_value, schema_types
from llmkit.core.parsing.reasoning import create_reasoning_parser
from llmkit.core.parsing.tool_parser import create_tool_parser


def tool(name, **props):
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": props}},
    }


TOOLS = [
    tool(
        "get_weather",
        city={"type": "string"},
        days={"type": "integer"},
        metric={"type": "boolean"},
        ratio={"type": "number"},
        tags={"type": "array", "items": {"type": "string"}},
        opts={"type": "object"},
        nothing={"type": "null"},
        maybe={"type": ["integer", "null"]},
        label={"anyOf": [{"type": "integer"}, {"type": "string"}]},
    ),
    tool("write_file", path={"type": "string"}, content={"type": "string"}),
    tool("get_time"),
]


def call(name, *params, close=True):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}" + ("</function>\n</tool_call>" if close else "")


def feed_all(chunks, tools=TOOLS):
    """Feed chunks then finish: (content, [(name, arguments)], deltas)."""
    p = create_tool_parser("qwen3_coder", tools=tools)
    content, deltas = "", []
    for ch in [*chunks, None]:
        d = p.feed(ch) if ch is not None else p.finish()
        content += d.content
        deltas += d.calls
    return content, [(c.name, c.arguments) for c in p.calls], deltas


def parse(text, tools=TOOLS):
    """Whole, char by char and in 7-char chunks: all three must agree; returns (content, calls)."""
    content, calls = create_tool_parser("qwen3_coder", tools=tools).parse(text)
    calls = [(c.name, c.arguments) for c in calls]
    for chunks in (list(text), [text[i : i + 7] for i in range(0, len(text), 7)]):
        got_content, got_calls, deltas = feed_all(chunks, tools)
        assert (got_content, got_calls) == (content, calls)
        check_deltas(deltas, calls)
    return content, calls


def check_deltas(deltas, calls):
    """The name first (with an id, no arguments), then fragments that join to the arguments."""
    seen: dict[int, str] = {}
    for d in deltas:
        if d.index not in seen:
            assert d.id is not None and d.name is not None and d.arguments == ""
            seen[d.index] = ""
        else:
            assert d.id is None and d.name is None
            seen[d.index] += d.arguments
    assert [seen[i] for i in sorted(seen)] == [a for _, a in calls]


def args(calls):
    return [(n, json.loads(a)) for n, a in calls]


def test_one_call_after_text():
    content, calls = parse("Let me look.\n\n" + call("get_weather", ("city", "Paris"), ("days", "3")))
    assert content == "Let me look."
    assert calls == [("get_weather", '{"city": "Paris", "days": 3}')]


def test_several_calls_and_text_after():
    text = call("get_weather", ("city", "Paris")) + "\n" + call("get_time") + "\nDone."
    content, calls = parse(text)
    assert content == "Done."
    assert calls == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


def test_parameters_typed_by_the_schema():
    _, calls = parse(
        call(
            "get_weather",
            ("city", "42"),
            ("days", "3"),
            ("metric", "true"),
            ("ratio", "0.5"),
            ("tags", '["a", "b"]'),
            ("opts", '{"unit": "C", "n": [1, 2]}'),
            ("nothing", "null"),
            ("maybe", "null"),
            ("label", "7"),
        )
    )
    assert args(calls) == [
        (
            "get_weather",
            {
                "city": "42",
                "days": 3,
                "metric": True,
                "ratio": 0.5,
                "tags": ["a", "b"],
                "opts": {"unit": "C", "n": [1, 2]},
                "nothing": None,
                "maybe": None,
                "label": 7,
            },
        )
    ]


def test_values_that_do_not_parse_fall_back_to_the_text():
    _, calls = parse(
        call("get_weather", ("days", "three"), ("metric", "True"), ("tags", "[a, b"), ("ratio", "NaN"), ("label", "x"))
    )
    assert args(calls) == [
        ("get_weather", {"days": "three", "metric": True, "tags": "[a, b", "ratio": "NaN", "label": "x"})
    ]


def test_parameters_not_in_the_schema_try_json_then_text():
    _, calls = parse(call("get_time", ("n", "5"), ("xs", "[1, 2]"), ("s", "hello world"), ("q", '"quoted"')))
    assert args(calls) == [("get_time", {"n": 5, "xs": [1, 2], "s": "hello world", "q": "quoted"})]


def test_strings_are_verbatim_less_one_newline_each_side():
    code = 'def f(x):\n    return x < 3 and "</p>" != x\n'
    text = f"<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\n{code}\n</parameter>\n</function>\n</tool_call>"
    _, calls = parse(text)
    assert args(calls) == [("write_file", {"path": "a.py", "content": code})]
    # no newlines at all, and two on each side (only one is layout)
    _, calls = parse("<tool_call><function=write_file><parameter=path>\n\n b \n\n</parameter></function></tool_call>")
    assert args(calls) == [("write_file", {"path": "\n b \n"})]
    _, calls = parse("<tool_call><function=write_file><parameter=path>x</parameter><parameter=content></parameter>")
    assert args(calls) == [("write_file", {"path": "x", "content": ""})]


def test_string_parameters_stream_as_written():
    text = call("write_file", ("content", "line one\nline two"))
    p = create_tool_parser("qwen3_coder", tools=TOOLS)
    pieces = [d.arguments for ch in text for d in p.feed(ch).calls]
    pieces += [d.arguments for d in p.finish().calls]
    assert '"line one\\nline two"' not in pieces and "o" in pieces  # many small pieces, not one
    assert json.loads("".join(pieces)) == {"content": "line one\nline two"}


def test_missing_parameter_end_tags():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n3\n</function>\n</tool_call>"
    )
    assert args(parse(text)[1]) == [("get_weather", {"city": "Paris", "days": 3})]
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</tool_call>\nAfter."
    assert parse(text) == ("After.", [("get_weather", '{"city": "Paris"}')])


def test_missing_function_and_tool_call_end_tags():
    text = call("get_weather", ("city", "Paris"), close=False) + call("get_time")
    assert parse(text)[1] == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    text = call("get_weather", ("city", "Paris"), close=False) + "</function>"
    assert parse(text) == ("", [("get_weather", '{"city": "Paris"}')])


def test_several_functions_in_one_block():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
        "<function=get_time>\n</function>\n<function=write_file>\n<parameter=path>\na\n</parameter>\n"
        "<function=get_time>\n</tool_call>"  # write_file lacks </function>
    )
    expected = [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", "{}"),
        ("write_file", '{"path": "a"}'),
        ("get_time", "{}"),
    ]
    assert parse(text) == ("", expected)
    assert parse(text, tools=[]) == ("", expected)  # inside a block, no request tool list is needed


@pytest.mark.parametrize(
    "tail, expected",
    [
        ("<parameter=days>\n3\n</para", {"city": "Paris", "days": 3}),  # a partial closing tag is dropped
        ("<parameter=days>\n3", {"city": "Paris", "days": 3}),
        ("<parameter=da", {"city": "Paris"}),
        ("<parameter=", {"city": "Paris"}),
        ("<param", {"city": "Paris"}),
        ("", {"city": "Paris"}),
    ],
)
def test_cut_off_call_keeps_what_was_written(tail, expected):
    text = "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n" + tail
    content, calls = parse(text)
    assert content == "Sure." and args(calls) == [("get_weather", expected)]


def test_cut_off_inside_a_string_value_closes_it():
    content, calls = parse("<tool_call>\n<function=write_file>\n<parameter=content>\nhello\nwor")
    assert content == "" and calls == [("write_file", '{"content": "hello\\nwor"}')]


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n</tool_call>",
        "<tool_call>\nno function here\n</tool_call> and more",
        "<tool_call>\n<function=rm_rf>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_wea",
        "<tool_call>",
        "Use <function=unknown_tool> like this.",
        "a <tool_call",
    ],
)
def test_not_a_call_stays_content(text):
    assert parse(text) == (text.strip(), [])


def test_text_before_a_failed_block_and_a_good_call_after():
    text = "Hi <tool_call>oops</tool_call> then " + call("get_time")
    assert parse(text) == ("Hi <tool_call>oops</tool_call> then", [("get_time", "{}")])


def test_function_without_tool_call_wrapper():
    # Qwen3-Coder sometimes drops <tool_call>; only a request tool's name makes it a call.
    text = "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>"
    assert parse(text) == ("", [("get_weather", '{"city": "Paris"}')])
    assert parse(text, tools=[]) == (text, [])


def test_no_tools_in_the_request_means_any_name_and_untyped_values():
    assert parse(call("anything", ("n", "1"), ("s", "x")), tools=[]) == ("", [("anything", '{"n": 1, "s": "x"}')])


def test_schema_types():
    assert schema_types({"type": "string"}) == {"string"}
    assert schema_types({"type": ["integer", "null"]}) == {"integer", "null"}
    assert schema_types({"type": "int"}) == {"integer"}  # loose names some tool definitions use
    assert schema_types({"enum": ["a", "b"]}) == {"string"}
    assert schema_types({"oneOf": [{"type": "string"}, {"$ref": "#/$defs/X"}]}) is None
    assert schema_types({"description": "no type"}) is None
    assert convert_value("3.0", frozenset({"integer"})) == 3.0
    assert convert_value("3", frozenset({"string", "null"})) == "3"
    assert convert_value('"3"', frozenset({"integer"})) == "3"  # JSON, if not the declared type


def test_qwen35_output_after_a_template_opened_think_block():
    """Qwen3.5/3.6 templates end the prompt with ``<think>\\n``: the output starts inside reasoning
    and only closes it; a call may follow, or come without closing the block."""
    prompt = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    the_call = call("get_weather", ("city", "Paris"))
    for output, reasoning, content in [
        ("The user wants weather.\n</think>\n\n" + the_call, "The user wants weather.", ""),
        ("Need the tool.\n</think>\n\nChecking.\n" + the_call, "Need the tool.", "Checking."),
        ("Need the tool.\n" + the_call, "Need the tool.", ""),  # no </think>: the call ends reasoning
    ]:
        for chunks in ([output], list(output)):
            rp = create_reasoning_parser("qwen3", prompt_text=prompt)
            tp = create_tool_parser("qwen3_coder", tools=TOOLS)
            r = c = ""
            for ch in [*chunks, None]:
                dr, dc = rp.feed(ch) if ch is not None else rp.finish("stop")
                r += dr
                c += tp.feed(dc).content
            c += tp.finish().content
            assert (r, c) == (reasoning, content)
            assert [(x.name, x.arguments) for x in tp.calls] == [("get_weather", '{"city": "Paris"}')]
    # thinking off: the template renders an empty block, so everything is content
    off = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert create_reasoning_parser("qwen3", prompt_text=off).parse("Hi </think> x") == ("", "Hi </think> x")


def test_linear_time_on_long_and_many_parameters():
    code = ("x = '<p>' < 3  # \\n \" 日本\n" * 40_000)[:1_000_000]
    many = "".join(f"<parameter=p{i}>\n{i}\n</parameter>\n" for i in range(30_000))
    for text, n in [
        (call("write_file", ("content", code)), 1),
        ("<tool_call>\n<function=get_time>\n" + many + "</function>\n</tool_call>", 30_000),
    ]:
        start = time.perf_counter()
        _, whole_calls = create_tool_parser("qwen3_coder", tools=TOOLS).parse(text)
        streamed = feed_all([text[i : i + 101] for i in range(0, len(text), 101)])
        assert time.perf_counter() - start < 2.0
        assert streamed[1] == [(c.name, c.arguments) for c in whole_calls]
        assert len(json.loads(whole_calls[0].arguments)) == n
    assert json.loads(whole_calls[0].arguments)["p29999"] == 29999


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<function=get_weather>",
    "<function=write_file>",
    "<function=nope>",
    "<function=",
    "</function>",
    "<parameter=city>",
    "<parameter=days>",
    "<parameter=content>",
    "<parameter=",
    "</parameter>",
    "</para",
    ">",
    "\n",
    " ",
    "3",
    "Paris",
    '"',
    "\\",
    "{",
    "[1]",
    "答",
    "🙂",
]


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.sampled_from(FRAGMENTS), max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_fuzz_streaming_equals_whole(parts, cuts):
    text = "".join(parts)
    points = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    content, calls = create_tool_parser("qwen3_coder", tools=TOOLS).parse(text)
    calls = [(c.name, c.arguments) for c in calls]
    got_content, got_calls, deltas = feed_all(chunks)
    assert (got_content, got_calls) == (content, calls)
    check_deltas(deltas, calls)
    for _, a in calls:
        assert isinstance(json.loads(a), dict)  # always a valid object, however broken the text
