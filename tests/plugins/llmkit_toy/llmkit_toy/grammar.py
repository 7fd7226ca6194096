"""A toy grammar backend: a ``regex`` of literal alternatives (``yes|no``) constrains the output to
exactly one of them. Small, but a real implementation of the grammar-backend contract."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from llmkit.core import CompiledGrammar, GrammarBackend, GrammarError, GrammarMatcher


class ChoiceMatcher(GrammarMatcher):
    def __init__(self, backend: "ChoiceBackend", choices: tuple[str, ...]):
        self.backend, self.choices, self.text, self.done = backend, choices, "", False

    def accept_token(self, token_id: int) -> bool:
        if token_id in self.backend.stop_ids and self.text in self.choices:
            self.done = True
            return True
        new = self.text + self.backend.pieces[token_id]
        if not any(c.startswith(new) for c in self.choices):
            return False
        self.text = new
        return True

    def fill_next_token_bitmask(self, bitmask: Any, row: int) -> None:
        ok = [any(c.startswith(self.text + p) and p for c in self.choices) for p in self.backend.pieces]
        mask = torch.tensor(ok, dtype=torch.bool)
        if self.text in self.choices:
            mask[list(self.backend.stop_ids)] = True
        bitmask[row, : len(mask)] = mask

    def is_terminated(self) -> bool:
        return self.done

    def rollback(self, num_tokens: int = 1) -> None:
        raise NotImplementedError("the toy backend does not roll back")

    def reset(self) -> None:
        self.text, self.done = "", False


class ChoiceGrammar(CompiledGrammar):
    def __init__(self, backend, choices):
        self.backend, self.choices = backend, choices

    def new_matcher(self) -> ChoiceMatcher:
        return ChoiceMatcher(self.backend, self.choices)


class ChoiceBackend(GrammarBackend):
    def __init__(self, *, tokenizer: Any, vocab_size: int, stop_token_ids=(), **options: Any):
        super().__init__()
        self.vocab_size = vocab_size
        self.stop_ids = frozenset(stop_token_ids)
        n = len(tokenizer)
        self.pieces = [tokenizer.decode([i]) for i in range(n)] + [""] * max(0, vocab_size - n)

    def build(self, kind: str, source: str, param: str, timeout: float) -> CompiledGrammar:
        if kind != "regex" or not all(c.isalnum() for c in source.replace("|", "")):
            raise GrammarError(param, "the toy backend accepts only a regex of literal alternatives: a|b|c")
        return ChoiceGrammar(self, tuple(source.split("|")))

    def allocate_bitmask(self, batch_size: int, vocab_size: int | None = None) -> Any:
        return torch.zeros(batch_size, vocab_size or self.vocab_size, dtype=torch.bool)

    def apply_bitmask(self, logits: Any, bitmask: Any, rows: Sequence[int]) -> None:
        for r in rows:
            logits[r, : bitmask.shape[1]].masked_fill_(~bitmask[r].to(logits.device), float("-inf"))
