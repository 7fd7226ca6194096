"""The xgrammar grammar backend (``--grammar-backend xgrammar``, the default).

Compilation happens in killable subprocesses (:mod:`.worker_pool`); the compiled grammar comes back
as xgrammar's own JSON serialisation and is rebuilt here against the same tokenizer info (~2 ms for
a typical schema). Matching and bitmask application run in the engine process.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Sequence

import xgrammar as xgr

from llmkit.core.grammar.contract import CompiledGrammar, GrammarBackend, GrammarError, GrammarMatcher
from llmkit.core.grammar.limits import clean_compiler_message

from .worker_pool import CompileWorkerPool, WorkerCrashed, WorkerTimeout

_WHAT = {
    "json_schema": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "ebnf": "EBNF grammar",
    "structural_tag": "structural tag",
}


class XGrammarMatcher(GrammarMatcher):
    """One sequence's xgrammar matcher, with a budget on total bitmask time.

    The budget is a backstop for grammars whose matching cost grows with the output (ambiguous
    repetitions the pre-checks did not catch): past it, filling raises GrammarError so the engine
    fails this request instead of slowing every request in the batch.
    """

    def __init__(self, compiled: xgr.CompiledGrammar, param: str, time_budget_s: float):
        self._matcher = xgr.GrammarMatcher(compiled)
        self._param = param
        self._budget = time_budget_s
        self._spent = 0.0

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(int(token_id)))

    def fill_next_token_bitmask(self, bitmask: Any, row: int) -> None:
        start = time.perf_counter()
        self._matcher.fill_next_token_bitmask(bitmask, row)
        self._spent += time.perf_counter() - start
        if self._spent > self._budget:
            raise GrammarError(
                self._param, f"the grammar is too expensive to match (over {self._budget:g} s of matching)"
            )

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def rollback(self, num_tokens: int = 1) -> None:
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)

    def reset(self) -> None:
        self._matcher.reset()
        self._spent = 0.0


class XGrammarCompiled(CompiledGrammar):
    """An xgrammar CompiledGrammar; ``memory_bytes`` is xgrammar's own estimate of its size."""

    def __init__(self, compiled: xgr.CompiledGrammar, param: str, time_budget_s: float):
        self.compiled = compiled
        self.memory_bytes = int(compiled.memory_size_bytes)
        self._param = param
        self._budget = time_budget_s

    def new_matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self.compiled, self._param, self._budget)


class XGrammarBackend(GrammarBackend):
    """Structured output with xgrammar token bitmasks.

    Options: ``stop_token_ids`` (default: the tokenizer's EOS), ``compile_workers`` (subprocesses,
    default 2 so one hostile compile never blocks the rest), ``compile_threads`` per worker,
    ``max_grammar_bytes`` (a compiled grammar larger than this is a 400), ``matcher_time_budget_s``,
    plus the base class's ``limits``, ``cache_max_bytes``, ``cache_max_entries``.
    """

    def __init__(
        self,
        *,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int] | None = None,
        compile_workers: int = 2,
        compile_threads: int = 1,
        max_grammar_bytes: int = 64 << 20,
        matcher_time_budget_s: float = 5.0,
        **options: Any,
    ):
        super().__init__(**options)
        self.vocab_size = int(vocab_size)
        self.matcher_time_budget_s = matcher_time_budget_s
        # xgrammar's view of the vocabulary and the compile workers are built with the first
        # constrained request (reading the vocabulary took ~0.5 s of every server's start)
        self._tokenizer, self._stop_token_ids = tokenizer, stop_token_ids
        self._pool_init = {"max_threads": compile_threads, "max_grammar_bytes": max_grammar_bytes}
        self._pool_size = compile_workers
        self._lazy = threading.Lock()
        self._tokenizer_info: xgr.TokenizerInfo | None = None
        self._pool: CompileWorkerPool | None = None
        self._finalizer = None

    @property
    def tokenizer_info(self) -> xgr.TokenizerInfo:
        with self._lazy:
            if self._tokenizer_info is None:
                self._tokenizer_info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
                )
            return self._tokenizer_info

    @property
    def pool(self) -> CompileWorkerPool:
        info = self.tokenizer_info
        with self._lazy:
            if self._pool is None:
                init = {"tokenizer_info": info.serialize_json(), **self._pool_init}
                self._pool = CompileWorkerPool(init, size=self._pool_size)
                self._finalizer = weakref.finalize(self, self._pool.close)
            return self._pool

    def build(self, kind: str, source: str, param: str, timeout: float) -> XGrammarCompiled:
        what = _WHAT[kind]
        try:
            reply = self.pool.run({"kind": kind, "source": source}, timeout)
        except WorkerTimeout:
            raise GrammarError(param, f"Compiling the {what} took longer than {timeout:g} s") from None
        except WorkerCrashed:
            raise GrammarError(param, f"The {what} crashed the grammar compiler") from None
        if not reply.get("ok"):
            message = clean_compiler_message(str(reply.get("error", "")))
            raise GrammarError(param, f"Invalid {what}: {message}")
        compiled = xgr.CompiledGrammar.deserialize_json(reply["compiled"], self.tokenizer_info)
        return XGrammarCompiled(compiled, param, self.matcher_time_budget_s)

    def allocate_bitmask(self, batch_size: int, vocab_size: int | None = None) -> Any:
        return xgr.allocate_token_bitmask(batch_size, vocab_size or self.vocab_size)

    def apply_bitmask(self, logits: Any, bitmask: Any, rows: Sequence[int]) -> None:
        if len(rows) == 0:
            return
        if bitmask.device != logits.device:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        # indices= leaves unconstrained rows untouched (and skips their cost on CPU).
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=list(rows))

    def warmup(self, timeout: float | None = None) -> None:
        self.pool.wait_ready(timeout)

    def close(self) -> None:
        with self._lazy:
            if self._finalizer is not None:
                self._finalizer()
