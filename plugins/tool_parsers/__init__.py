"""Built-in tool-call parsers (``--tool-call-parser NAME``), registered like third-party plugins."""

from __future__ import annotations

from llmkit.core.hookspecs import hookimpl

_PARSERS = {
    "hermes": "hermes:HermesToolParser",
    "llama3": "llama3:Llama3ToolParser",
    "mistral": "mistral:MistralToolParser",
    "json_array": "mistral:JsonArrayToolParser",
    "deepseekv3": "deepseek:DeepSeekV3ToolParser",
    "kimi_k2": "kimi_k2:KimiK2ToolParser",
    "qwen3_coder": "qwen3_coder:Qwen3CoderToolParser",
    "pythonic": "pythonic:PythonicToolParser",
    "gpt-oss": "gpt_oss:GptOssToolParser",
    "gemma4": "gemma4:Gemma4ToolParser",
    "glm45": "glm45:Glm45ToolParser",
    "minimax_m2": "minimax_m2:MiniMaxM2ToolParser",
}


@hookimpl
def llmkit_register_tool_parsers(register):
    for name, target in _PARSERS.items():
        register(name, f"{__name__}.{target}")
