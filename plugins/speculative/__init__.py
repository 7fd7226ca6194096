"""Speculative algorithms: ``NGRAM`` (prompt and continuation lookup, no weights)."""

from __future__ import annotations

from llmkit.core.hookspecs import hookimpl


@hookimpl
def llmkit_register_speculative_algorithms(register):
    register("NGRAM", "llmkit.plugins.speculative.ngram:NgramProposer")
