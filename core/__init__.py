"""llmkit core: the contracts plugins implement, and the engine. Never imports a plugin module.

A plugin author imports everything from here::

    from llmkit.core import hookimpl, AttentionBackend, CausalLM, ReasoningParser, ...

Names resolve lazily (on first access), so ``import llmkit.core`` stays cheap: ``llmkit --help``
must not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the module that defines it
_EXPORTS = {
    "hookimpl": "llmkit.core.hookspecs",
    "PluginError": "llmkit.core.plugins",
    "registry": "llmkit.core.plugins",
    # models and attention
    "AttentionBackend": "llmkit.core.model.attention",
    "AttentionMetadata": "llmkit.core.model.attention",
    "CausalLM": "llmkit.core.model.causal_lm",
    "ForwardContext": "llmkit.core.model.causal_lm",
    "KVCachePool": "llmkit.core.kvcache.kv_pool",
    "Linear": "llmkit.core.model.linear",
    "LMHead": "llmkit.core.model.linear",
    "VocabEmbedding": "llmkit.core.model.linear",
    "WeightFormat": "llmkit.core.model.linear",
    "dense_linear": "llmkit.core.model.linear",
    "TPGroup": "llmkit.core.model.parallel",
    "FusedExperts": "llmkit.core.model.moe",
    "RMSNorm": "llmkit.core.model.layers",
    "RotaryEmbedding": "llmkit.core.model.layers",
    # parsers
    "ReasoningParser": "llmkit.core.parsing.reasoning",
    "ThinkTagReasoningParser": "llmkit.core.parsing.reasoning",
    "ToolParser": "llmkit.core.parsing.tool_parser",
    "StreamingToolParser": "llmkit.core.parsing.tool_parser",
    "ToolCall": "llmkit.core.parsing.tool_parser",
    "JsonScanner": "llmkit.core.parsing.text_scan",
    "first_marker": "llmkit.core.parsing.text_scan",
    "partial_marker_len": "llmkit.core.parsing.text_scan",
    # structured output
    "GrammarBackend": "llmkit.core.grammar.contract",
    "CompiledGrammar": "llmkit.core.grammar.contract",
    "GrammarMatcher": "llmkit.core.grammar.contract",
    "GrammarError": "llmkit.core.grammar.contract",
    "GrammarSpec": "llmkit.core.grammar.contract",
    "clean_compiler_message": "llmkit.core.grammar.limits",
    # speculative decoding
    "Proposer": "llmkit.core.speculative.contract",
    # LoRA adapters found by name at run time
    "LoRAResolver": "llmkit.core.lora.resolver",
    # the KV cache's storage tier
    "KVStorage": "llmkit.core.kvcache.kv_storage",
    # files and batches storage
    "StorageBackend": "llmkit.core.batches.storage",
    "StorageError": "llmkit.core.batches.storage",
    "NotFoundError": "llmkit.core.batches.storage",
    "FileTooLargeError": "llmkit.core.batches.storage",
    "FileRecord": "llmkit.core.batches.storage",
    "BatchRecord": "llmkit.core.batches.storage",
    "BatchResult": "llmkit.core.batches.storage",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'llmkit.core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
