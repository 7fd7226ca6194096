"""Requests and sampling parameters: plain dataclasses shared by the engine and the server."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch


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


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class Request:
    """One sequence being generated. ``n > 1`` is n requests that share a prompt."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower runs first: online traffic 0, batch lines 1
    eos_token_ids: frozenset[int] = frozenset()
    arrival: float = field(default_factory=time.monotonic)
    grammar: Any = None  # a grammar matcher, when the output is constrained
    grammar_wait_for: str | None = None  # apply the grammar only once this text (a reasoning end tag) is out
    return_prompt_logprobs: bool = False

    # engine state
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched_stop: int | str | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first prefill)
    generator: torch.Generator | None = None
    # KV bookkeeping (owned by the scheduler)
    req_pool_idx: int | None = None
    num_computed: int = 0  # tokens whose K/V are in the pool
    prefix_handle: Any = None
    prefix_len: int = 0  # leading tokens whose pages belong to the prefix cache
    own_pages: list[int] = field(default_factory=list)
    preemptions: int = 0
    first_prefill_done: bool = False
    # A step that samples this request's next token is running and not yet read back (overlap
    # schedule): the scheduler already plans the step after it, one token further.
    inflight: bool = False

    @property
    def grammar_active(self) -> bool:
        return self.grammar is not None and self.grammar_wait_for is None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_ids[start:end]`` without building the concatenation (a decode step needs one token)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
