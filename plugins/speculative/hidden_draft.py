"""Draft layers over the target's hidden states (EAGLE's and EAGLE-3's heads, DeepSeek's MTP
layer): what they share. The runner hands each forward's captured states to :meth:`HiddenStateProposer.observe`; a
proposal feeds the draft layer the positions the target computed since the last one, then its own
output for each further draft token.

Position ``i`` of the draft layer's K/V cache holds (the target's hidden state at ``i``, the token
at ``i + 1``): the state at ``i`` predicted token ``i + 1``, and with it the layer predicts token
``i + 2``. Rows built from draft tokens are cut off before the next proposal; rows built from the
target's own states and tokens are final, so each step feeds only the positions the target
computed since (the draft tokens it accepted included).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field

import torch

from llmkit.core.multimodal.items import as_placeholders
from llmkit.core.speculative.contract import Proposer
from llmkit.core.speculative.tree import DraftTree
from llmkit.plugins.speculative.draft_cache import DraftKV
from llmkit.plugins.speculative.tree_search import search_tree, top_k


@dataclass
class _DraftState:
    """One request's draft state: the head's K/V (row ``j`` is position ``first + j``), how many of
    its rows came from the target's own features (final), and the target's features not fed yet."""

    kv: DraftKV = field(default_factory=DraftKV)
    first: int | None = None  # the first position with features (a prefix-cache hit has none before)
    exact: int = 0
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> feature row
    # the last tree verified: (its root's position, the tree, its nodes' feature rows), resolved
    # into ``pending`` once the tokens it kept are known
    tree: tuple[int, DraftTree, torch.Tensor] | None = None


class HiddenStateProposer(Proposer):
    """Sets ``feature_layers`` (the target layer inputs it reads), ``device`` and ``max_position``,
    and implements :meth:`draft_layer` and :meth:`draft_scores`.

    Under ``--speculative-eagle-topk K`` (K > 1) it drafts a tree as EAGLE-2 and SGLang do (see
    :mod:`~llmkit.plugins.speculative.tree_search`)."""

    drafts_trees = True
    feature_layers: tuple[int, ...] = ()
    device: torch.device = torch.device("cpu")
    max_position: int = 1 << 30
    image_token: int = 0  # a vision-language target's image placeholder (``image_token_of``)

    @abstractmethod
    def draft_layer(self, hidden, tokens, positions, kv: DraftKV, from_target: bool) -> torch.Tensor:
        """One pass over ``tokens`` at ``positions`` (their rows appended to ``kv``): ``hidden`` is
        the target's captured states (``from_target``) or the layer's own outputs. Returns the
        output states (the next pass's input)."""

    @abstractmethod
    def draft_scores(self, out: torch.Tensor) -> torch.Tensor:
        """Logits for output rows ``out``, over the head's vocabulary (see :meth:`to_target`)."""

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """The head's token ids as the target's (the same, unless the head has its own vocabulary)."""
        return ids

    def observe(self, req, start: int, rows: torch.Tensor, tree: DraftTree | None = None) -> None:
        """The target computed positions ``[start, start + len(rows))`` of ``req`` with these
        features (rows past the accepted tokens are overwritten when recomputed); for a ``tree``
        segment, the root at ``start`` and then its nodes' rows."""
        state = req.spec_state if isinstance(req.spec_state, _DraftState) else None
        if state is None:
            state = req.spec_state = _DraftState(first=start)
        elif state.first is None:
            state.first = start
        lo = state.first + state.exact  # rows before this are in the head's K/V for good
        if tree is not None:
            state.tree = (start, tree, rows[1:])
            rows = rows[:1]
        for j in range(rows.shape[0]):
            if start + j >= lo:
                state.pending[start + j] = rows[j]

    def _resolve_tree(self, state: _DraftState, ids: list[int], n: int) -> None:
        """The rows of the last tree's nodes that the target kept, at the positions they now hold."""
        if state.tree is None:
            return
        root, tree, rows = state.tree
        state.tree = None
        node = -1
        for pos in range(root + 1, n):
            node = tree.child(node, ids[pos])
            if node is None:
                break
            state.pending[pos] = rows[node]

    @torch.inference_mode()
    def propose(self, req, max_tokens: int) -> list[int] | DraftTree:
        state = req.spec_state
        if not isinstance(state, _DraftState) or state.first is None:
            return []
        ids = req.all_ids
        n = req.num_computed  # features are final for positions [0, n); token n is the last one
        self._resolve_tree(state, ids, n)
        if n + max_tokens > self.max_position or n >= len(ids):
            return []
        kv = state.kv
        kv.cut(state.exact)  # the last proposal's draft rows
        lo = state.first + state.exact
        positions = list(range(lo, n))
        if not positions or any(p not in state.pending for p in positions):
            return []  # (features missing: a chunk not seen; no draft this step)
        feats = torch.stack([state.pending.pop(p) for p in positions])  # (observe keeps none below lo)
        tokens = ids[lo + 1 : n + 1]
        if req.mm is not None:  # the head reads an image's tokens as its placeholder (see the module)
            tokens = as_placeholders(tokens, self.image_token)
        hidden = self.draft_layer(feats, self._ids(tokens), self._ids(positions), kv, True)[-1:]
        kv.length += len(positions)
        kv.ids.extend(tokens)
        state.exact = kv.length
        if self.topk > 1:
            return self._tree(kv, hidden, n, max_tokens)
        draft = [self._best(hidden)]
        # Each later draft token from the head's own output: the row that predicted draft token
        # ``step`` stands in for the target's features at position n + step - 1.
        for step in range(1, max_tokens):
            hidden = self.draft_layer(hidden, self._ids(draft[-1:]), self._ids([n + step - 1]), kv, False)
            kv.length += 1
            kv.ids.append(draft[-1])
            draft.append(self._best(hidden))
        return draft

    def _best(self, out: torch.Tensor) -> int:
        return int(self.to_target(self.draft_scores(out[-1:]).argmax(dim=-1))[0])

    def _top(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top K target ids and their log-probabilities, ``[rows, K]`` each."""
        ids, logp = top_k(self.draft_scores(out), self.topk)
        return self.to_target(ids), logp

    def _tree(self, kv: DraftKV, hidden: torch.Tensor, n: int, depth: int) -> DraftTree:
        """The tree of the class docstring, ``depth`` deep; ``hidden``: the head's output at the
        last target row (it predicts the first draft token)."""

        def feed(inputs, tokens, positions):
            return self.draft_layer(inputs, self._ids(tokens), self._ids(positions), kv, False)

        return search_tree(kv, hidden, feed, self._top, depth, n)

    def _ids(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
