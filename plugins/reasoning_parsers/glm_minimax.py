"""GLM-4.5 and MiniMax-M2 reasoning parsers: ``<think>`` … ``</think>``.

* ``glm45`` (GLM-4.5, 4.6, 4.7): thinking is on by default; GLM-4.5 writes ``<think>`` itself,
  GLM-4.7's template prefills it (detected from the prompt). ``enable_thinking: false`` makes the
  template close an empty block, which turns parsing off. A ``<tool_call>`` inside reasoning ends it.
* ``minimax_m2`` (MiniMax-M2, M2.1): always thinking, the output starts inside reasoning (the
  ``<think>`` at its head, where the model writes one, is dropped).
"""

from __future__ import annotations

from llmkit.core.parsing.reasoning import ThinkTagReasoningParser


class Glm45ReasoningParser(ThinkTagReasoningParser):
    thinking_kwarg = "allow"
    tool_start = "<tool_call>"


class MiniMaxM2ReasoningParser(ThinkTagReasoningParser):
    forces_reasoning = True
    tool_start = "<minimax:tool_call>"
