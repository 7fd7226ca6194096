"""Built-in reasoning parsers (``--reasoning-parser NAME``), registered like any third-party plugin."""

from __future__ import annotations

from llmkit.core.hookspecs import hookimpl

_PARSERS = {
    "qwen3": "qwen3:Qwen3ReasoningParser",
    "qwen3-thinking": "qwen3:Qwen3ThinkingReasoningParser",
    "deepseek-r1": "deepseek:DeepSeekR1ReasoningParser",
    "deepseek-v3": "deepseek:DeepSeekV3ReasoningParser",
    "kimi": "kimi:KimiReasoningParser",
    "gpt-oss": "gpt_oss:GptOssReasoningParser",
    "gemma4": "gemma4:Gemma4ReasoningParser",
    "glm45": "glm_minimax:Glm45ReasoningParser",
    "minimax_m2": "glm_minimax:MiniMaxM2ReasoningParser",
}


@hookimpl
def llmkit_register_reasoning_parsers(register):
    for name, target in _PARSERS.items():
        register(name, f"{__name__}.{target}")
