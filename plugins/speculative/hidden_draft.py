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
from llmkit.plugins.speculative.draft_cache import DraftKV


@dataclass
class _DraftState:
    """One request's draft state: the head's K/V (row ``j`` is position ``first + j``), how many of
    its rows came from the target's own features (final), and the target's features not fed yet."""

    kv: DraftKV = field(default_factory=DraftKV)
    first: int | None = None  # the first position with features (a prefix-cache hit has none before)
    exact: int = 0
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> feature row


class HiddenStateProposer(Proposer):
    """Sets ``feature_layers`` (the target layer inputs it reads), ``device`` and ``max_position``,
    and implements :meth:`draft_layer`."""

    feature_layers: tuple[int, ...] = ()
    device: torch.device = torch.device("cpu")
    max_position: int = 1 << 30
    image_token: int = 0  # a vision-language target's image placeholder (``image_token_of``)

    @abstractmethod
    def draft_layer(self, hidden, tokens, positions, kv: DraftKV, from_target: bool):
        """One pass over ``tokens`` at ``positions`` (their rows appended to ``kv``): ``hidden`` is
        the target's captured states (``from_target``) or the layer's own last output. Returns the
        output states (the next pass's input) and the target token id predicted for each row."""

    def observe(self, req, start: int, rows: torch.Tensor) -> None:
        """The target computed positions ``[start, start + len(rows))`` of ``req`` with these
        features (rows past the accepted tokens are overwritten when recomputed)."""
        state = req.spec_state if isinstance(req.spec_state, _DraftState) else None
        if state is None:
            state = req.spec_state = _DraftState(first=start)
        elif state.first is None:
            state.first = start
        lo = state.first + state.exact  # rows before this are in the head's K/V for good
        for j in range(rows.shape[0]):
            if start + j >= lo:
                state.pending[start + j] = rows[j]

    @torch.inference_mode()
    def propose(self, req, max_tokens: int) -> list[int]:
        state = req.spec_state
        if not isinstance(state, _DraftState) or state.first is None:
            return []
        ids = req.all_ids
        n = req.num_computed  # features are final for positions [0, n); token n is the last one
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
        hidden, best = self.draft_layer(feats, self._ids(tokens), self._ids(positions), kv, True)
        kv.length += len(positions)
        kv.ids.extend(tokens)
        state.exact = kv.length
        draft = [int(best[-1])]
        hidden = hidden[-1:]
        # Each later draft token from the head's own output: the row that predicted draft token
        # ``step`` stands in for the target's features at position n + step - 1.
        for step in range(1, max_tokens):
            hidden, best = self.draft_layer(hidden, self._ids(draft[-1:]), self._ids([n + step - 1]), kv, False)
            kv.length += 1
            kv.ids.append(draft[-1])
            draft.append(int(best[-1]))
        return draft

    def _ids(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
