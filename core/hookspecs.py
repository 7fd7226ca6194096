"""Hook specifications: one per extension point.

Every hook takes a ``register`` callback (``app`` for commands). ``register(name, factory,
**metadata)`` takes a name and either a ``"package.module:Attribute"`` string or a callable; strings
are imported only when that name is chosen, so a missing optional dependency fails only then.
Metadata is what the plugin declares about itself, read without importing it: ``auto={"cuda": 20}``
(attention: rank in ``--attention auto``), ``model_types=("llama",)`` (models: configs without
``architectures``), ``default=True`` (grammar, storage: the default backend), ``path_option="path"``
(storage: the option ``--file-storage-path`` fills).
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("llmkit")
hookimpl = pluggy.HookimplMarker("llmkit")


@hookspec
def llmkit_register_attention_backends(register):
    """Register attention backends: ``register("torch", "pkg.mod:Backend")``.

    The factory is a subclass of :class:`llmkit.core.model.attention.AttentionBackend`.
    """


@hookspec
def llmkit_register_models(register):
    """Register model architectures by ``config.architectures[0]``.

    The factory is a subclass of :class:`llmkit.core.model.causal_lm.CausalLM`.
    """


@hookspec
def llmkit_register_reasoning_parsers(register):
    """Register reasoning parsers (``--reasoning-parser NAME``)."""


@hookspec
def llmkit_register_tool_parsers(register):
    """Register tool-call parsers (``--tool-call-parser NAME``)."""


@hookspec
def llmkit_register_storage_backends(register):
    """Register batch/file storage backends (``--batch-storage NAME``)."""


@hookspec
def llmkit_register_grammar_backends(register):
    """Register structured-output grammar backends (``--grammar-backend NAME``)."""


@hookspec
def llmkit_register_speculative_algorithms(register):
    """Register speculative decoding algorithms (``--speculative-algorithm NAME``).

    The factory is a subclass of :class:`llmkit.core.speculative.contract.Proposer`.
    """


@hookspec
def llmkit_register_lora_resolvers(register):
    """Register LoRA adapter resolvers (``--lora-resolver NAME``).

    The factory is a subclass of :class:`llmkit.core.lora.resolver.LoRAResolver`.
    """


@hookspec
def llmkit_register_commands(app):
    """Add commands to the Typer ``app`` of the ``llmkit`` CLI."""
