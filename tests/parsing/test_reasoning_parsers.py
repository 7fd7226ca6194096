"""Reasoning parsers: real-format texts, stream vs non-stream, edge cases, linear time."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmkit.core.parsing.reasoning import create_reasoning_parser, reasoning_parser_class
from llmkit.core.plugins import PluginError, registry

QWEN_ON = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
QWEN_OFF = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN_PLAIN = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
HARMONY_PROMPT = "<|start|>user<|message|>hi<|end|><|start|>assistant"


def run(name, chunks, finish="stop", **kw):
    """Feed ``chunks`` one by one; return the concatenated (reasoning, content)."""
    p = create_reasoning_parser(name, **kw)
    r = c = ""
    for ch in chunks:
        dr, dc = p.feed(ch)
        r, c = r + dr, c + dc
    dr, dc = p.finish(finish)
    return r + dr, c + dc


def whole(name, text, finish="stop", **kw):
    return create_reasoning_parser(name, **kw).parse(text, finish)


def chars(text):
    return list(text)


def test_all_parsers_registered():
    assert set(registry().names("reasoning_parser")) >= {
        "qwen3",
        "qwen3-thinking",
        "deepseek-r1",
        "deepseek-v3",
        "kimi",
        "gpt-oss",
    }
    assert reasoning_parser_class("gpt-oss").keep_special_tokens is True
    assert reasoning_parser_class("qwen3").keep_special_tokens is False


def test_unknown_name_lists_valid_names():
    with pytest.raises(PluginError, match="qwen3-thinking"):
        create_reasoning_parser("nope")


@pytest.mark.parametrize("split", [None, 1, 3])
def test_qwen3_model_opened(split):
    text = "<think>\nLet me think: 9.11 < 9.8.\n</think>\n\n9.8 is greater."
    chunks = [text] if split is None else [text[i : i + split] for i in range(0, len(text), split)]
    assert run("qwen3", chunks, prompt_text=QWEN_PLAIN) == (
        "Let me think: 9.11 < 9.8.",
        "9.8 is greater.",
    )


def test_qwen3_template_prefilled_and_disabled():
    assert whole("qwen3", "r</think>\n\nans", prompt_text=QWEN_ON) == ("r", "ans")
    # enable_thinking false renders an empty block: everything is content, even tags.
    assert whole("qwen3", "Hello <think>x</think>", prompt_text=QWEN_OFF) == (
        "",
        "Hello <think>x</think>",
    )
    off = {"enable_thinking": False}
    assert whole("qwen3", "<think>a</think>b", chat_template_kwargs=off) == (
        "",
        "<think>a</think>b",
    )
    # Without any tags the answer is content (QwQ-style "no tags → all reasoning" is not repeated).
    assert whole("qwen3", "Just an answer.", prompt_text=QWEN_PLAIN) == ("", "Just an answer.")


@pytest.mark.parametrize("stream_reasoning", [True, False])
def test_qwen35_template_opened_block_closed_by_the_model(stream_reasoning):
    """Qwen3.5/3.6 templates prefill ``<think>\\n`` (thinking is on unless turned off), so the
    output holds only the end tag; enable_thinking false renders an empty block instead."""
    text = "The user greets me.\nI reply.\n</think>\n\nHello! 👋"
    for chunks in ([text], chars(text)):
        assert run("qwen3", chunks, prompt_text=QWEN_ON, stream_reasoning=stream_reasoning) == (
            "The user greets me.\nI reply.",
            "Hello! 👋",
        )
    assert run("qwen3", chars("Hello!"), prompt_text=QWEN_OFF, stream_reasoning=stream_reasoning) == ("", "Hello!")


def test_literal_tags_inside_content_stay_content():
    text = "<think>r</think>Use </think> and <think> literally."
    assert run("qwen3", chars(text)) == ("r", "Use </think> and <think> literally.")
    assert whole("qwen3", "Answer: <think> is a tag") == ("", "Answer: <think> is a tag")


def test_end_tag_and_content_in_one_delta():
    p = create_reasoning_parser("deepseek-r1")
    assert p.feed("I reason") == ("I reason", "")
    assert p.feed(" more</think>The answer") == (" more", "The answer")
    assert p.finish("stop") == ("", "")


def test_partial_tags_are_held_not_leaked():
    p = create_reasoning_parser("qwen3-thinking")
    assert p.feed("abc</th") == ("abc", "")
    assert p.feed("in") == ("", "")
    assert p.feed("k>ok") == ("", "ok")


def test_truncated_by_length_stays_reasoning():
    for sr in (True, False):
        assert whole("deepseek-r1", "still thinking", "length", stream_reasoning=sr) == (
            "still thinking",
            "",
        )


def test_stop_in_template_opened_block_keeps_answer():
    # Buffered (non-stream) mode: a model that skipped thinking keeps its answer as content.
    assert whole("qwen3", "The answer.", prompt_text=QWEN_ON, stream_reasoning=False) == (
        "",
        "The answer.",
    )
    # A block the model opened itself is reasoning even when it stops.
    assert whole("qwen3", "<think>hmm", stream_reasoning=False) == ("hmm", "")
    # Already streamed reasoning cannot be taken back.
    assert whole("qwen3", "The answer.", prompt_text=QWEN_ON) == ("The answer.", "")


def test_stream_reasoning_false_emits_one_piece_before_content():
    p = create_reasoning_parser("deepseek-r1", stream_reasoning=False)
    assert p.feed("step 1, ") == ("", "")
    assert p.feed("step 2") == ("", "")
    assert p.feed("</think>\n\nDone") == ("step 1, step 2", "Done")


def test_deepseek_r1_strips_repeated_open_tag():
    assert whole("deepseek-r1", "<think>\nr</think>a") == ("r", "a")


def test_deepseek_v3_thinking_kwarg():
    on = {"thinking": True}
    assert whole("deepseek-v3", "r</think>a", chat_template_kwargs=on) == ("r", "a")
    assert whole("deepseek-v3", "r</think>a", chat_template_kwargs={"enable_thinking": True}) == (
        "r",
        "a",
    )
    assert whole("deepseek-v3", "plain answer") == ("", "plain answer")
    assert whole("deepseek-v3", "a</think>", chat_template_kwargs={"thinking": False}) == (
        "",
        "a</think>",
    )


def test_qwen3_thinking_forced():
    assert whole("qwen3-thinking", "思考中🙂</think>答案") == ("思考中🙂", "答案")


def test_kimi_needs_explicit_tag():
    assert whole("kimi", "◁think▷想一想◁/think▷答案") == ("想一想", "答案")
    assert whole("kimi", "no tags here</think>") == ("", "no tags here</think>")


HARMONY = (
    "<|channel|>analysis<|message|>User says hi. Respond.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! 👋<|return|>"
)
HARMONY_CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"SF"}<|call|>'
)


def test_gpt_oss_channels():
    assert whole("gpt-oss", HARMONY, prompt_text=HARMONY_PROMPT) == (
        "User says hi. Respond.",
        "Hello! 👋",
    )
    assert run("gpt-oss", chars(HARMONY)) == ("User says hi. Respond.", "Hello! 👋")
    r, c = run("gpt-oss", chars(HARMONY_CALL), stream_reasoning=False)
    assert r == "Need the weather."
    assert c.endswith('<|message|>{"city":"SF"}<|call|>') and "to=functions.get_weather" in c
    # The #9139 regression: reasoning must not end up in content.
    assert "analysis" not in whole("gpt-oss", HARMONY)[1]


def test_gpt_oss_preamble_and_unknown_text():
    text = "<|channel|>commentary<|message|>Checking…<|end|><|start|>assistant<|channel|>final<|message|>ok<|return|>"
    assert whole("gpt-oss", text) == ("", "Checking…ok")
    assert whole("gpt-oss", "no markers at all") == ("", "no markers at all")


# -- property: any split gives the same result as one piece ------------------------------------
CASES = [
    ("qwen3", "<think>\n让我想想 🤔 a<b and </b>\n</think>\n\n答案是 42 <think> ok", {}),
    ("qwen3", "r1 🙂 </thi </think>ans", {"prompt_text": QWEN_ON}),
    ("qwen3", "  plain 答 <thi", {"prompt_text": QWEN_PLAIN}),
    ("qwen3", "<think>x</think>", {"prompt_text": QWEN_OFF}),
    ("qwen3-thinking", "思考 </think\n</think>\n\n回答 🚀", {}),
    ("deepseek-r1", "<think>\n<think>r 🧠</think>a </think>", {}),
    ("deepseek-v3", "r</think>a", {"chat_template_kwargs": {"thinking": True}}),
    ("kimi", "◁think▷嗯◁/thi◁/think▷好的◁think▷", {}),
    ("gpt-oss", HARMONY, {"prompt_text": HARMONY_PROMPT}),
    ("gpt-oss", HARMONY_CALL, {}),
    ("gpt-oss", "<|chan<|channel|>analysis<|message|>a<|en<|end|>x", {}),
]


@settings(max_examples=60, deadline=None)
@given(
    case=st.sampled_from(CASES),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
    finish=st.sampled_from(["stop", "length"]),
    stream_reasoning=st.booleans(),
)
def test_streaming_equals_non_streaming(case, cuts, finish, stream_reasoning):
    name, text, kw = case
    points = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    kw = dict(kw, stream_reasoning=stream_reasoning)
    assert run(name, chunks, finish, **kw) == whole(name, text, finish, **kw)


@pytest.mark.parametrize("name", ["qwen3", "qwen3-thinking", "deepseek-r1", "kimi", "gpt-oss"])
def test_linear_time_on_adversarial_text(name):
    unit = "<thi</thin◁thi◁/thi<|chan<|end <|sta" + "x" * 8
    text = unit * (1_000_000 // len(unit))
    start = time.perf_counter()
    r, c = whole(name, text)
    chunked = run(name, [text[i : i + 997] for i in range(0, len(text), 997)])
    elapsed = time.perf_counter() - start
    assert (r, c) == chunked
    assert len(r) + len(c) > 900_000
    assert elapsed < 1.0, elapsed


FRAGMENTS = [
    "<tool_call>",
    "<think>",
    "</think>",
    "<thi",
    "</",
    "◁think▷",
    "◁/think▷",
    "<|channel|>",
    "analysis",
    "final",
    "<|message|>",
    "<|end|>",
    "<|start|>",
    "assistant",
    "<|return|>",
    "<|call|>",
    " to=functions.f",
    "\n",
    " ",
    "答",
    "🙂",
    "a",
]


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(["qwen3", "qwen3-thinking", "deepseek-r1", "deepseek-v3", "kimi", "gpt-oss"]),
    parts=st.lists(st.sampled_from(FRAGMENTS), max_size=25),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=10),
    prompt=st.sampled_from(["", QWEN_ON, QWEN_OFF, HARMONY_PROMPT]),
    finish=st.sampled_from(["stop", "length"]),
    stream_reasoning=st.booleans(),
)
def test_fuzz_streaming_equals_non_streaming(name, parts, cuts, prompt, finish, stream_reasoning):
    text = "".join(parts)
    points = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    kw = {"prompt_text": prompt, "stream_reasoning": stream_reasoning}
    assert run(name, chunks, finish, **kw) == whole(name, text, finish, **kw)


def test_constrained_answer_prefix_opens_the_final_channel_only_inside_a_header():
    """gpt-oss's template ends in "<|start|>assistant": a constrained answer (a forced tool call)
    must start in a message body, so the server appends the final channel's header first."""
    p = create_reasoning_parser("gpt-oss", prompt_text="<|start|>user<|message|>Hi<|end|><|start|>assistant")
    assert p.constrained_answer_prefix == "<|channel|>final<|message|>"
    primed = "<|start|>assistant<|channel|>final<|message|>"
    assert create_reasoning_parser("gpt-oss", prompt_text=primed).constrained_answer_prefix == ""
    assert create_reasoning_parser("qwen3", prompt_text="<|im_start|>assistant\n").constrained_answer_prefix == ""
    # after the prefix, the constrained text is content
    p = create_reasoning_parser("gpt-oss", prompt_text="<|start|>assistant" + p.constrained_answer_prefix)
    assert p.parse('[{"name": "f", "parameters": {}}]') == ("", '[{"name": "f", "parameters": {}}]')
