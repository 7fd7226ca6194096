"""``--grammar-backend none``: structured output switched off; every constraint is a 400."""

from __future__ import annotations

from typing import Any, Sequence

from llmkit.core.grammar.contract import CompiledGrammar, GrammarBackend, GrammarError, GrammarSpec


class DisabledGrammarBackend(GrammarBackend):
    """Refuses every constraint with a GrammarError naming the request field it came from.

    Requests without a constraint never reach a backend, so they are unaffected.
    """

    MESSAGE = "Structured output is disabled on this server (--grammar-backend none)."

    def __init__(self, *, tokenizer: Any = None, vocab_size: int = 0, **options: Any):
        super().__init__()
        self.vocab_size = vocab_size

    def compile(self, spec: GrammarSpec, timeout: float = 5.0) -> CompiledGrammar:
        raise GrammarError(spec.param, self.MESSAGE)

    async def compile_async(self, spec: GrammarSpec, timeout: float = 5.0) -> CompiledGrammar:
        raise GrammarError(spec.param, self.MESSAGE)

    def build(self, kind: str, source: str, param: str, timeout: float) -> CompiledGrammar:
        raise GrammarError(param, self.MESSAGE)

    def allocate_bitmask(self, batch_size: int, vocab_size: int | None = None) -> Any:
        raise RuntimeError("no grammar backend: nothing is constrained")

    def apply_bitmask(self, logits: Any, bitmask: Any, rows: Sequence[int]) -> None:
        if len(rows):
            raise RuntimeError("no grammar backend: nothing is constrained")
