"""``--speculative-algorithm NGRAM``: the draft is what followed the last earlier occurrence of the
sequence's last few tokens (prompt lookup decoding). Code edits, quotes and documents filled from
their source repeat long runs of the prompt, and a run once started tends to go on.

Each request keeps an index from every n-gram (``min_match``..``max_match`` tokens) to where its
most recent occurrences end, grown by the tokens appended since the last step: a lookup costs a
few dictionary probes, whatever the sequence's length.

Under ``--speculative-eagle-topk K`` (K > 1) the draft is a tree of up to K continuations: those
of the most recent occurrences of the longest matching n-gram first, then of shorter ones, merged
where they agree. The best guess (the one a chain would draft) is the tree's main chain.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmkit.core.speculative.contract import Proposer
from llmkit.core.speculative.tree import DraftTree


@dataclass
class _Index:
    # n-gram -> ends of its latest occurrences (the most recent last; one unless drafting trees)
    ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    upto: int = 0  # n-grams ending at positions < upto are indexed


class NgramProposer(Proposer):
    drafts_trees = True

    def __init__(self, min_match: int = 2, max_match: int = 4, **options) -> None:
        super().__init__(**options)
        if not 1 <= min_match <= max_match:
            raise ValueError(f"NGRAM match window {min_match}..{max_match}: need 1 <= min <= max")
        self.min_match, self.max_match = min_match, max_match

    def propose(self, req, max_tokens: int) -> list[int] | DraftTree:
        ids = req.all_ids
        n = len(ids)
        index = req.spec_state if isinstance(req.spec_state, _Index) else _Index()
        req.spec_state = index
        # Index the n-grams that end before the last token: the suffix itself must not match itself.
        ends, keep = index.ends, self.topk
        for end in range(max(index.upto, 1), n):
            for size in range(self.min_match, min(self.max_match, end) + 1):
                seen = ends.setdefault(tuple(ids[end - size : end]), [])
                seen.append(end)
                if len(seen) > keep:
                    del seen[0]
        index.upto = max(index.upto, n)
        paths: list[list[int]] = []
        for size in range(min(self.max_match, n - 1), self.min_match - 1, -1):  # the longest match first
            for end in reversed(ends.get(tuple(ids[n - size :]), ())):
                path = ids[end : end + max_tokens]
                if path and path not in paths:
                    paths.append(path)
            if len(paths) >= keep:
                break
        if keep == 1 or len(paths) < 2:
            return paths[0] if paths else []
        return DraftTree.from_paths(paths[:keep], max_nodes=max_tokens * keep, max_depth=max_tokens)
