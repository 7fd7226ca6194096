"""What crosses the engine boundary: plain dataclasses of ints, floats, strings and lists.

The server builds a :class:`GenerateRequest` and reads :class:`RequestOutput` objects back.
Everything stateful (KV pages, random generators, grammar matchers, the detokenizer) lives on the
engine side and is created there from these messages. :func:`to_wire` / :func:`from_wire` map
them to and from plain dicts (msgpack- and JSON-ready), so the engine can move to another process
without the server changing.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from llmkit.core.grammar.contract import GrammarSpec


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings (already validated by the server)."""

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0 (or < 1e-6) means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    stop_regex: tuple[str, ...] = ()  # SGLang's stop_regex: stop where one of these matches the text

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6

    @property
    def needs_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @functools.cached_property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes a row's logits or asks for its logprobs: the sampler
        takes such rows' argmax alone (read every step for every row, so computed once)."""
        return (
            self.greedy
            and not self.logit_bias
            and not self.needs_penalties
            and not self.min_new_tokens
            and not self.logprobs
        )


@dataclass(frozen=True)
class GenerateRequest:
    """One sequence to generate (``n > 1`` is n requests that share a prompt)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower runs first: online traffic 0, batch lines 1
    grammar: GrammarSpec | None = None  # the engine compiles it and keeps the matcher
    # Constrain only after one of these strings appears in the output (a reasoning parser's end
    # tag, when the output starts inside reasoning): the reasoning itself stays free text.
    grammar_after: tuple[str, ...] = ()
    return_prompt_logprobs: bool = False
    lora: str | None = None  # the name of the LoRA adapter to generate with (None: the base model)
    # The prompt's images (``llmkit.core.multimodal.items.MultimodalInputs``): its ``prompt_ids``
    # hold each image's run of placeholder tokens, which the engine keys by the image's hash.
    mm: Any = None
    # The prefix-cache space of its K/V beyond the adapter's (the API key's owner, vLLM's
    # ``cache_salt``): a prefix is reused only by requests of the same salt. None: shared.
    cache_salt: str | None = None


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class RequestOutput:
    """New output of one request since its previous output; the last one has ``finished``."""

    rid: str
    text: str = ""  # new text since the previous output
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None
    # Seconds from arrival at the engine to first being scheduled, on the first output (None if the
    # request never ran). Only the engine knows it; the server's /metrics observes it.
    queue_time: float | None = None


def to_wire(msg: Any) -> dict:
    """A message as a plain dict (nested dataclasses included); tuples become lists."""
    if isinstance(msg, GenerateRequest) and msg.mm is not None:
        from llmkit.core.multimodal.wire import mm_to_wire

        return {**dataclasses.asdict(dataclasses.replace(msg, mm=None)), "mm": mm_to_wire(msg.mm)}
    return dataclasses.asdict(msg)


def from_wire(cls: type, data: dict) -> Any:
    """Rebuild a message of type ``cls`` from :func:`to_wire`'s dict (or its msgpack round trip)."""
    if cls is GenerateRequest:
        g = data.get("grammar")
        mm = data.get("mm")
        if mm is not None:
            from llmkit.core.multimodal.wire import mm_from_wire

            mm = mm_from_wire(mm)
        return GenerateRequest(
            **{
                **data,
                "mm": mm,
                "prompt_ids": list(data["prompt_ids"]),
                "params": from_wire(SamplingParams, data["params"]),
                "grammar": GrammarSpec(**g) if g is not None else None,
                "grammar_after": tuple(data.get("grammar_after", ())),
            }
        )
    if cls is SamplingParams:
        bias = data.get("logit_bias")
        return SamplingParams(
            **{
                **data,
                "stop": tuple(data["stop"]),
                "stop_token_ids": tuple(data["stop_token_ids"]),
                "stop_regex": tuple(data.get("stop_regex", ())),
                "logit_bias": {int(k): float(v) for k, v in bias.items()} if bias else None,
            }
        )
    if cls is TokenLogprob:
        return TokenLogprob(data["token_id"], data["logprob"], [tuple(t) for t in data["top"]])
    if cls is RequestOutput:
        lp = lambda d: None if d is None else from_wire(TokenLogprob, d)  # noqa: E731
        prompt = data.get("prompt_logprobs")
        return RequestOutput(
            **{
                **data,
                "logprobs": [lp(d) for d in data["logprobs"]],
                "prompt_logprobs": None if prompt is None else [lp(d) for d in prompt],
            }
        )
    raise TypeError(f"not an engine message type: {cls!r}")
