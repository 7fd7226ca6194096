"""Speculative algorithms: ``NGRAM`` (prompt and continuation lookup, no weights) and
``STANDALONE`` (a smaller draft model with the same tokenizer)."""

from __future__ import annotations

from llmkit.core.hookspecs import hookimpl


@hookimpl
def llmkit_register_speculative_algorithms(register):
    register("NGRAM", "llmkit.plugins.speculative.ngram:NgramProposer")
    register("STANDALONE", "llmkit.plugins.speculative.standalone:StandaloneProposer")
