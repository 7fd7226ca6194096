"""Speculative algorithms: ``NGRAM`` (prompt and continuation lookup, no weights),
``STANDALONE`` (a smaller draft model with the same tokenizer), ``EAGLE`` and ``EAGLE3`` (EAGLE-1/2's
and EAGLE-3's draft heads over the target's hidden states), ``MTP`` (DeepSeek-V3's multi-token-prediction layer)."""

from __future__ import annotations

from llmkit.core.hookspecs import hookimpl


@hookimpl
def llmkit_register_speculative_algorithms(register):
    register("NGRAM", "llmkit.plugins.speculative.ngram:NgramProposer")
    register("STANDALONE", "llmkit.plugins.speculative.standalone:StandaloneProposer")
    register("EAGLE", "llmkit.plugins.speculative.eagle:EagleProposer")
    register("EAGLE3", "llmkit.plugins.speculative.eagle3:Eagle3Proposer")
    register("MTP", "llmkit.plugins.speculative.mtp:MTPProposer")
