"""Qwen3 reasoning parsers: ``<think>`` … ``</think>``.

* ``qwen3`` serves the hybrid models. Thinking is on by default and the model writes ``<think>``
  itself, so the block is recognised when the output starts with it. ``enable_thinking: false``
  (the template then renders an empty ``<think>\\n\\n</think>`` block, detected from the prompt)
  turns parsing off: everything is content. A template that prefills ``<think>`` (as the
  2507 and later templates do) is detected from the prompt and starts the output in reasoning.
* ``qwen3-thinking`` serves Qwen3-*-Thinking-2507: the template ends the prompt with ``<think>``
  and the model never writes one, so output always starts inside reasoning.

For both, a ``<tool_call>`` inside reasoning ends it: the call goes to content, where the tool
parser finds it, instead of being lost inside reasoning_content.
"""

from __future__ import annotations

from llmkit.core.parsing.reasoning import ThinkTagReasoningParser


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    """Hybrid Qwen3: reasoning when the prompt or the model opens ``<think>``."""

    thinking_kwarg = "allow"
    tool_start = "<tool_call>"


class Qwen3ThinkingReasoningParser(ThinkTagReasoningParser):
    """Qwen3 Thinking-2507: output always starts inside reasoning; ``enable_thinking`` is ignored."""

    forces_reasoning = True
    tool_start = "<tool_call>"
