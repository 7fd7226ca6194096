"""``--speculative-algorithm NGRAM``: the draft is what followed the last earlier occurrence of the
sequence's last few tokens (prompt lookup decoding). Code edits, quotes and documents filled from
their source repeat long runs of the prompt, and a run once started tends to go on.

Each request keeps an index from every n-gram (``min_match``..``max_match`` tokens) to where its
most recent occurrence ends, grown by the tokens appended since the last step: a lookup costs a
few dictionary probes, whatever the sequence's length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmkit.core.speculative.contract import Proposer


@dataclass
class _Index:
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end of its latest occurrence
    upto: int = 0  # n-grams ending at positions < upto are indexed


class NgramProposer(Proposer):
    def __init__(self, min_match: int = 2, max_match: int = 4, **options) -> None:
        super().__init__(**options)
        if not 1 <= min_match <= max_match:
            raise ValueError(f"NGRAM match window {min_match}..{max_match}: need 1 <= min <= max")
        self.min_match, self.max_match = min_match, max_match

    def propose(self, req, max_tokens: int) -> list[int]:
        ids = req.all_ids
        n = len(ids)
        index = req.spec_state if isinstance(req.spec_state, _Index) else _Index()
        req.spec_state = index
        # Index the n-grams that end before the last token: the suffix itself must not match itself.
        ends = index.ends
        for end in range(max(index.upto, 1), n):
            for size in range(self.min_match, min(self.max_match, end) + 1):
                ends[tuple(ids[end - size : end])] = end
        index.upto = max(index.upto, n)
        for size in range(min(self.max_match, n - 1), self.min_match - 1, -1):  # the longest match wins
            end = ends.get(tuple(ids[n - size :]))
            if end is not None:
                return ids[end : end + max_tokens]
        return []
