"""The proposer contract: what a speculative algorithm plugin implements.

A proposer sees a running request (its prompt and output ids, and a ``spec_state`` slot it may
keep anything in) and returns up to ``max_tokens`` draft tokens that continue it. It never has to
be right: the engine verifies every draft token against the target model and keeps only those
the target would have produced, so a proposer can only change speed, never output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class Proposer(ABC):
    """One speculative algorithm (``--speculative-algorithm NAME``), built once per engine."""

    # True: it reads the target's embedding or LM head (a draft head). Under tensor parallelism
    # every rank then gathers them for rank 0 at start, and the proposer gets them as its
    # ``target_vocab`` option (a ``core.speculative.target_vocab.TargetVocab``; None with one rank).
    reads_target_vocab = False
    # True: it may run on another device than the target's (``--speculative-draft-device``): it
    # reads token ids only, never the target's tensors
    runs_on_any_device = False
    # True: under ``--speculative-eagle-topk K`` above 1 (its ``topk`` option) it may return a
    # :class:`~llmkit.core.speculative.tree.DraftTree` of up to K candidates instead of a chain
    drafts_trees = False

    def __init__(self, topk: int | None = None, **options: Any) -> None:
        self.options = options
        self.topk = max(1, topk or 1)  # --speculative-eagle-topk (above 1: a proposer that drafts_trees)

    @abstractmethod
    def propose(self, req, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` token ids that may follow ``req.all_ids`` (fewer, or none, when
        the proposer has no good guess: an empty draft decodes one token as usual); a proposer
        that :attr:`drafts_trees` may return a ``DraftTree`` at most ``max_tokens`` deep."""

    def release(self, req) -> None:
        """``req`` ended: drop what was kept for it (the default keeps it on the request)."""
        req.spec_state = None
