"""Structured-output grammar backends: ``xgrammar`` (default) and ``none`` (disabled).

Registered lazily, so xgrammar is imported only when that backend is created.
"""

from llmkit.core.hookspecs import hookimpl


@hookimpl
def llmkit_register_grammar_backends(register):
    register("xgrammar", "llmkit.plugins.grammar.xgrammar_backend:XGrammarBackend", default=True)
    register("none", "llmkit.plugins.grammar.none_backend:DisabledGrammarBackend")
