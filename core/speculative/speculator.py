"""Which running requests get a draft this step, and how long, from the proposer plugin; the
acceptance counters the decode log line and /metrics report.

Adaptive, per request:
- a request whose drafts keep being rejected stops getting them for a while (doubling up to
  ``MAX_BACKOFF`` steps, reset by an accepted draft), so text the proposer cannot predict (plain
  chat for a lookup proposer) decodes as it would without speculation;
- its draft length follows its acceptance: after a partly rejected draft, one more than the tokens
  kept; after a wholly kept one, twice as long, up to ``--speculative-num-draft-tokens``. Every
  verify row costs the step some compute (on the CPU a 5-row step takes ~1.3x a one-row step; on a
  loaded GPU batch, rows compete with other requests), so rows a draft is unlikely to keep are not
  scored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from llmkit.core.speculative.contract import Proposer
from llmkit.core.speculative.tree import DraftTree

log = logging.getLogger("llmkit")

MAX_BACKOFF = 64  # steps a request goes without drafts after repeated misses, at most


@dataclass
class SpecStats:
    verify_steps: int = 0  # decode steps of a request that carried a draft
    draft_tokens: int = 0  # draft tokens scored
    accepted_tokens: int = 0  # draft tokens kept

    def as_dict(self) -> dict:
        """The engine's stats keys (summed over data-parallel replicas, read by /metrics)."""
        return {
            "spec_verify_steps": self.verify_steps,
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
        }

    @property
    def accept_length(self) -> float:
        """Mean tokens a verify step emits (accepted drafts + the target's own token), SGLang's
        ``accept len``."""
        return (self.accepted_tokens + self.verify_steps) / max(1, self.verify_steps)


class Speculator:
    def __init__(
        self, name: str, proposer: Proposer, num_draft_tokens: int, max_context: int, max_nodes: int | None = None
    ) -> None:
        self.name = name
        self.proposer = proposer
        self.num_draft_tokens = num_draft_tokens  # a chain's most tokens, a tree's most depth
        self.max_nodes = max_nodes or num_draft_tokens  # a tree's most nodes
        self.max_context = max_context
        self.stats = SpecStats()
        self._misses: dict[str, int] = {}  # rid -> drafts rejected in a row
        self._skip: dict[str, int] = {}  # rid -> steps left without drafts
        self._length: dict[str, int] = {}  # rid -> its draft length now (absent: the most)

    def draft(self, req) -> list[int] | DraftTree:
        """The draft tokens ``req`` decodes with this step (empty: a plain decode step), or a tree
        of them (a proposer that drafts trees, never for a request with images)."""
        if req.needs_prompt_logits:  # its logits rows are the prompt's only
            return []
        skip = self._skip.get(req.rid, 0)
        if skip:
            self._skip[req.rid] = skip - 1
            return []
        p = req.params
        # Every verify step emits up to len(draft) + 1 tokens: stay within max_tokens and the context.
        room = min(
            self._length.get(req.rid, self.num_draft_tokens),
            p.max_new_tokens - len(req.output_ids) - 1,
            self.max_context - req.seq_len - 1,
        )
        if room <= 0:
            return []
        draft = self.proposer.propose(req, room)
        if isinstance(draft, DraftTree):
            # each node takes a slot after the sequence's end: all within the context
            draft = draft.truncated(min(self.max_nodes, self.max_context - req.seq_len - 1), room)
            if req.mm is None and not draft.is_chain():
                return draft
            draft = draft.main_chain()  # (images: chains only, see below)
        draft = list(draft)[:room]
        if req.mm is not None:  # a copy of the prompt may reach an image's pseudo-ids: stop before
            from llmkit.core.multimodal.items import PSEUDO_BASE

            cut = next((i for i, t in enumerate(draft) if t >= PSEUDO_BASE), len(draft))
            draft = draft[:cut]
        return draft

    def record(self, req, drafted: int, accepted: int, depth: int | None = None) -> None:
        """A verify step of ``req`` kept ``accepted`` of ``drafted`` draft tokens (a tree's nodes,
        ``depth`` deep: its length, as a chain's, is its depth)."""
        self.stats.verify_steps += 1
        self.stats.draft_tokens += drafted
        self.stats.accepted_tokens += accepted
        depth = drafted if depth is None else depth
        if accepted == depth:
            self._length[req.rid] = min(self.num_draft_tokens, 2 * depth)
        else:
            self._length[req.rid] = accepted + 1
        if accepted:
            self._misses.pop(req.rid, None)
            return
        misses = self._misses.get(req.rid, 0) + 1
        self._misses[req.rid] = misses
        if misses >= 2:  # back off: 2, 4, 8, ... steps without drafts
            self._skip[req.rid] = min(MAX_BACKOFF, 1 << (misses - 1))

    def release(self, req) -> None:
        self._misses.pop(req.rid, None)
        self._skip.pop(req.rid, None)
        self._length.pop(req.rid, None)
        self.proposer.release(req)


def build_speculator(
    algorithm: str | None, num_draft_tokens: int, max_context: int, options: dict, max_nodes: int | None = None
) -> Speculator | None:
    """The speculator ``--speculative-algorithm`` names (None: speculation off)."""
    if not algorithm:
        return None
    from llmkit.core.plugins import registry

    proposer = registry().speculative_algorithm(algorithm)(**options)
    log.info("speculative decoding: %s, up to %d draft tokens a step", algorithm, num_draft_tokens)
    return Speculator(algorithm, proposer, num_draft_tokens, max_context, max_nodes)
