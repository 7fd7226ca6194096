"""Hook specifications: one per extension point.

Every hook takes a ``register`` callback (``app`` for commands). ``register(name, factory,
**metadata)`` takes a name and either a ``"package.module:Attribute"`` string or a callable; strings
are imported only when that name is chosen, so a missing optional dependency fails only then.
Metadata is what the plugin declares about itself, read without importing it: ``auto={"cuda": 20}``
(attention: rank in ``--attention auto``), ``model_types=("llama",)`` (models: configs without
``architectures``), ``default=True`` (grammar, storage: the default backend), ``path_option="path"``
(storage: the option ``--file-storage-path`` fills).

Each hook's docstring names the class a factory subclasses and, where llmkit ships a kit for it,
the :mod:`llmkit.testing` class that checks one in a plugin's own test suite (the kits import
pytest, which llmkit itself does not need).
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("llmkit")
hookimpl = pluggy.HookimplMarker("llmkit")


@hookspec
def llmkit_register_attention_backends(register):
    """Register attention backends (``--attention NAME``): ``register("torch", "pkg.mod:Backend")``.

    The factory is a subclass of :class:`llmkit.core.model.attention.AttentionBackend`. Test it
    with :class:`llmkit.testing.attention.AttentionBackendContract`: it checks the backend's K/V
    writes and outputs against the ``torch`` reference backend's on prefill, decode and mixed
    batches, and on each optional feature the backend lists.
    """


@hookspec
def llmkit_register_models(register):
    """Register model architectures by ``config.architectures[0]``.

    The factory is a subclass of :class:`llmkit.core.model.causal_lm.CausalLM`; a decoder-only
    transformer usually subclasses one of the shared stacks in :mod:`llmkit.core.model.decoder`
    instead (:class:`~llmkit.core.model.decoder.stack.DecoderLM` for Llama-style blocks,
    :class:`~llmkit.core.model.decoder.stack.StackedLM` with its own blocks). No test kit yet.
    """


@hookspec
def llmkit_register_reasoning_parsers(register):
    """Register reasoning parsers (``--reasoning-parser NAME``).

    The factory is a subclass of :class:`llmkit.core.parsing.reasoning.ReasoningParser`
    (:class:`~llmkit.core.parsing.reasoning.ThinkTagReasoningParser` for ``<think>``-style tags).
    No test kit yet.
    """


@hookspec
def llmkit_register_tool_parsers(register):
    """Register tool-call parsers (``--tool-call-parser NAME``).

    The factory is a subclass of :class:`llmkit.core.parsing.tool_parser.ToolParser`
    (:class:`~llmkit.core.parsing.tool_parser.StreamingToolParser` keeps the buffer and call
    bookkeeping the built-in parsers share). No test kit yet.
    """


@hookspec
def llmkit_register_storage_backends(register):
    """Register batch/file storage backends (``--batch-storage NAME``).

    The factory is a subclass of :class:`llmkit.core.batches.storage.StorageBackend`. Test it with
    :class:`llmkit.testing.storage.StorageContract`, and with
    :class:`llmkit.testing.storage.LeaseContract` too where it stores leases.
    """


@hookspec
def llmkit_register_grammar_backends(register):
    """Register structured-output grammar backends (``--grammar-backend NAME``).

    The factory is a subclass of :class:`llmkit.core.grammar.contract.GrammarBackend`. No test kit yet.
    """


@hookspec
def llmkit_register_speculative_algorithms(register):
    """Register speculative decoding algorithms (``--speculative-algorithm NAME``).

    The factory is a subclass of :class:`llmkit.core.speculative.contract.Proposer`. No test kit yet.
    """


@hookspec
def llmkit_register_lora_resolvers(register):
    """Register LoRA adapter resolvers (``--lora-resolver NAME``).

    The factory is a subclass of :class:`llmkit.core.lora.resolver.LoRAResolver`. No test kit yet.
    """


@hookspec
def llmkit_register_kv_storage(register):
    """Register the storage tier's backends (``--hicache-storage-backend NAME``), e.g.
    ``register("file", "pkg.mod:FileKVStorage", default=True)``.

    The factory is a subclass of :class:`llmkit.core.kvcache.kv_storage.KVStorage`, called with
    ``path=`` (``--hicache-storage-path``) and the keys of ``--hicache-storage-backend-extra-config``.
    No test kit yet.
    """


@hookspec
def llmkit_register_commands(app):
    """Add commands to the Typer ``app`` of the ``llmkit`` CLI.

    No class to subclass: add functions with ``@app.command()`` (a :class:`typer.Typer`). No test
    kit yet.
    """
