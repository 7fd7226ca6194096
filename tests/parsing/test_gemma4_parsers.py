"""Gemma 4's tool-call (``gemma4``) and reasoning (``gemma4``) parsers on outputs in its format (as
Google's function-calling and prompt-formatting guides record them): calls, the thought channel,
both chained as the server chains them; streaming cut anywhere equals non-streaming."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmkit.core.parsing.reasoning import create_reasoning_parser, reasoning_parser_class
from llmkit.core.parsing.tool_parser import create_tool_parser


def tool(name):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


TOOLS = [tool("get_current_temperature"), tool("add")]
Q = '<|"|>'
# a reply with prose, a call with a string and an enum value, and a call with nested values
REPLY = (
    "Let me check that for you.\n"
    f"<|tool_call>call:get_current_temperature{{location:{Q}London, UK{Q},unit:{Q}celsius{Q}}}<tool_call|>"
    f"<|tool_call>call:add{{a:1,b:-2.5,opts:{{exact:true,tags:[{Q}x, y{Q},null]}},note:{Q}a }} and : in it{Q}}}<tool_call|>"
)
CALLS = [
    ("get_current_temperature", {"location": "London, UK", "unit": "celsius"}),
    ("add", {"a": 1, "b": -2.5, "opts": {"exact": True, "tags": ["x, y", None]}, "note": "a } and : in it"}),
]


def stream_tools(chunks, tools=TOOLS):
    p = create_tool_parser("gemma4", tools=tools)
    content = ""
    for ch in [*chunks, None]:
        content += (p.feed(ch) if ch is not None else p.finish()).content
    return content, [(c.name, json.loads(c.arguments)) for c in p.calls]


def test_calls_are_read_into_json_arguments():
    assert stream_tools([REPLY]) == ("Let me check that for you.", CALLS)
    assert stream_tools(["<|tool_call>call:add{}<tool_call|>"]) == ("", [("add", {})])


@pytest.mark.parametrize(
    "text",
    [
        "<|tool_call>call:unknown{a:1}<tool_call|>",  # not one of the request's tools
        f"<|tool_call>call:add{{a:{Q}open}}<tool_call|>",  # an unclosed string
        "<|tool_call>call:add{a:1,,}<tool_call|>",  # arguments that do not read
        "<|tool_call>add(a=1)<tool_call|>",  # not the call form
        "<|tool_call>call:add{a:1}",  # cut off before its end marker
    ],
)
def test_what_is_not_a_call_stays_content(text):
    assert stream_tools(["Sure. ", text]) == ("Sure. " + text, [])


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=len(REPLY)), max_size=12))
def test_streaming_cut_anywhere_equals_non_streaming(cuts):
    points = sorted(set(cuts))
    chunks = [REPLY[a:b] for a, b in zip([0, *points], [*points, len(REPLY)])]
    assert stream_tools(chunks) == stream_tools([REPLY])


THOUGHT = "<|channel>thought\nThe user wants London's temperature.<channel|>"


def pipeline(chunks):
    """The reasoning parser, then the tool parser on its content, as the server chains them."""
    rp = create_reasoning_parser("gemma4", prompt_text="<|turn>user\nhi<turn|>\n<|turn>model\n")
    tp = create_tool_parser("gemma4", tools=TOOLS)
    reasoning = content = ""
    for ch in [*chunks, None]:
        dr, dc = rp.feed(ch) if ch is not None else rp.finish("stop")
        reasoning += dr
        content += tp.feed(dc).content
    content += tp.finish().content
    return reasoning.strip(), content, [(c.name, json.loads(c.arguments)) for c in tp.calls]


@pytest.mark.parametrize("split", [None, 1, 5])
def test_thought_channel_then_calls(split):
    text = THOUGHT + REPLY
    chunks = [text] if split is None else [text[i : i + split] for i in range(0, len(text), split)]
    assert pipeline(chunks) == ("The user wants London's temperature.", "Let me check that for you.", CALLS)


def test_answer_without_a_channel_is_all_content_and_markers_survive_detokenization():
    assert reasoning_parser_class("gemma4").keep_special_tokens is True
    assert pipeline(["Paris is the capital."]) == ("", "Paris is the capital.", [])
    # an empty channel (thinking off on the larger models) leaves the answer alone
    assert pipeline(["<|channel>thought\n<channel|>Paris."]) == ("", "Paris.", [])
