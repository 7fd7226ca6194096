"""What the scheduler hands the model runner each step: the segments of one forward."""

from __future__ import annotations

from dataclasses import dataclass

from llmkit.core.engine.request import Request
from llmkit.core.speculative.tree import DraftTree


@dataclass(slots=True)
class Segment:
    req: Request
    start: int  # first token position computed in this step
    length: int  # tokens computed, the draft's included
    # Speculative decoding: draft tokens after the sequence's last one, verified by this step (each
    # of the 1 + len(draft) rows is sampled, the first rejected draft token ending the run). Never
    # mutated: the default is one shared empty tuple, not a new list per segment per step.
    draft: list[int] | tuple[()] = ()
    # A tree draft (``draft`` holds its tokens, node order; see core/speculative/tree.py); None: the
    # draft is a chain
    tree: DraftTree | None = None

    @property
    def samples(self) -> bool:
        """Whether this segment reaches the sequence's end, so the next token is sampled (a token in
        flight counts: a chained step launches before it is appended)."""
        return self.start + self.length - len(self.draft) == self.req.seq_len + self.req.inflight


@dataclass
class ScheduledBatch:
    segments: list[Segment]
    num_new_prefill_seqs: int = 0
    num_prefill_tokens: int = 0
    num_cached_tokens: int = 0
    num_running_before: int = 0
    # Set by the scheduler when every segment is one token of a running request with no draft (the
    # common step): the runner and the engine then take their per-request fast paths.
    decode_only: bool = False

    @property
    def is_decode(self) -> bool:
        return all(s.length == 1 for s in self.segments)
