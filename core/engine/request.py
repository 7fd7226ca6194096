"""The engine-side state of one sequence, built from a :class:`GenerateRequest` message."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from llmkit.core.engine.messages import GenerateRequest, SamplingParams, TokenLogprob

__all__ = ["Request", "Status", "SamplingParams", "TokenLogprob"]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One sequence being generated (engine thread only)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower runs first: online traffic 0, batch lines 1
    eos_token_ids: frozenset[int] = frozenset()
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None  # when it was first admitted (queue time = this - arrival)
    grammar: Any = None  # a grammar matcher, when the output is constrained
    # While set, the grammar waits: a ReasoningEndScanner fed the output text until reasoning ends.
    reasoning_end: Any = None
    return_prompt_logprobs: bool = False
    lora: Any = None  # the LoRAAdapter its rows use (None: the base model)
    mm: Any = None  # its images (MultimodalInputs); their tokens in prompt_ids are pseudo-ids
    cache_salt: str | None = None  # its prefix-cache space beside the adapter's (owner, cache_salt)

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
    # Window layers' own pages, from window_base on; those before window_lo were given back
    # (core/kvcache/window_pages.py), under this admission's number
    window_pages: list[int] = field(default_factory=list)
    window_base: int = 0  # the position of window_pages[0]
    window_lo: int = 0
    window_admission: int = 0
    # A hybrid model's state snapshots taken for the prefix cache: (position, snapshot slot)
    snapshots: list[tuple[int, int]] = field(default_factory=list)
    first_prefill_done: bool = False
    # A step that samples this request's next token is running and not yet read back (overlap
    # schedule): the scheduler already plans the step after it, one token further.
    inflight: bool = False
    spec_state: Any = None  # what the speculative proposer keeps for this request (its n-gram index)

    @property
    def grammar_active(self) -> bool:
        return self.grammar is not None and self.reasoning_end is None

    @classmethod
    def from_message(cls, msg: GenerateRequest, eos_token_ids: frozenset[int]) -> "Request":
        ids = list(msg.prompt_ids)
        if msg.mm is not None:  # the prefix cache keys an image's tokens by its hash
            from llmkit.core.multimodal.items import pseudo_id

            for item, (off, n) in zip(msg.mm.items, msg.mm.spans):
                ids[off : off + n] = [pseudo_id(item.digest)] * n
        return cls(
            rid=msg.rid,
            prompt_ids=ids,
            params=msg.params,
            priority=msg.priority,
            eos_token_ids=eos_token_ids,
            return_prompt_logprobs=msg.return_prompt_logprobs,
            mm=msg.mm,
            cache_salt=msg.cache_salt,
        )

    @property
    def cache_namespace(self) -> int:
        """The prefix-cache space of its K/V: an adapter's K/V is never shared with another's, nor
        one salt's (owner's) prefixes with another's."""
        base = 0 if self.lora is None else self.lora.uid
        return base if self.cache_salt is None else hash((base, self.cache_salt))

    @property
    def tier_namespace(self) -> str | None:
        """Its space in the storage tier (stable across processes), or None: not stored there (an
        adapter's uid is this process's own, and a reloaded adapter keeps its name)."""
        if self.lora is not None:
            return None
        return "" if self.cache_salt is None else "salt:" + self.cache_salt

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
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs were asked for and the prompt has not been computed yet (so it is
        computed whole, without the prefix cache, and its logits are kept)."""
        return self.return_prompt_logprobs and not self.first_prefill_done

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
