"""What crosses the engine boundary is plain data: every message survives a msgpack round trip,
and the reasoning-end scan the engine runs for waiting constraints is incremental."""

from __future__ import annotations

import msgpack
import pytest

from llmkit.core.engine.messages import GenerateRequest, RequestOutput, SamplingParams, TokenLogprob, from_wire, to_wire
from llmkit.core.grammar.contract import GrammarSpec
from llmkit.core.parsing.reasoning import ReasoningEndScanner, create_reasoning_parser


def _round_trip(msg):
    data = msgpack.unpackb(msgpack.packb(to_wire(msg)), strict_map_key=False)
    return from_wire(type(msg), data)


def test_generate_request_round_trips():
    msg = GenerateRequest(
        rid="chatcmpl-1-0",
        prompt_ids=[1, 2, 3],
        params=SamplingParams(
            max_new_tokens=7,
            temperature=0.5,
            logit_bias={42: -3.0},
            seed=9,
            stop=("\n\n", "END"),
            stop_token_ids=(2,),
            logprobs=True,
            top_logprobs=2,
        ),
        priority=1,
        grammar=GrammarSpec("json_schema", {"type": "object", "properties": {"b": {}, "a": {}}}, param="tool_choice"),
        grammar_after=("</think>",),
        return_prompt_logprobs=True,
    )
    back = _round_trip(msg)
    assert to_wire(back) == to_wire(msg)  # GrammarSpec compares by identity; its fields must match
    assert back.params == msg.params and isinstance(back.grammar, GrammarSpec)
    assert list(_round_trip(msg).grammar.value["properties"]) == ["b", "a"]  # order kept


def test_request_output_round_trips():
    out = RequestOutput(
        rid="r",
        text="hé",
        token_ids=[5, 6],
        logprobs=[TokenLogprob(5, -0.1, [(5, -0.1), (7, -2.0)])],
        finished=True,
        finish_reason="stop",
        matched_stop="END",
        prompt_tokens=3,
        completion_tokens=2,
        cached_tokens=1,
        prompt_logprobs=[None, TokenLogprob(2, -1.0, [])],
    )
    assert _round_trip(out) == out


def test_nothing_engine_side_in_a_request():
    """No field of a request message holds engine state (matchers, generators, pages)."""
    msg = GenerateRequest("r", [1], SamplingParams())
    assert all(isinstance(v, (str, int, float, bool, list, dict, tuple, type(None))) for v in to_wire(msg).values())


@pytest.mark.parametrize(
    "deltas,ends_at",
    [
        (["Let me think", "...", "</thi", "nk>", "{"], 3),
        (["abc</think>"], 0),
        (["no end", " here"], None),
        (["<", "/", "t", "h", "i", "n", "k", ">"], 7),
    ],
)
def test_reasoning_end_scan_is_incremental(deltas, ends_at):
    scan = ReasoningEndScanner(("</think>",))
    hits = [scan.is_reasoning_end(d) for d in deltas]
    assert (hits.index(True) if True in hits else None) == ends_at
    assert len(scan._tail) < len("</think>")  # only a possible marker prefix is kept


def test_parsers_name_their_end_marker_only_inside_reasoning():
    inside = create_reasoning_parser("qwen3", prompt_text="<|im_start|>assistant\n<think>\n")
    off = create_reasoning_parser("qwen3", prompt_text="<think>\n\n</think>\n\n")
    assert inside.reasoning_end_markers == ("</think>",) and off.reasoning_end_markers == ()
