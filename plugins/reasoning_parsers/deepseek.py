"""DeepSeek reasoning parsers: ``<think>`` … ``</think>``.

* ``deepseek-r1``: the R1 template puts ``<think>`` in the prompt, so output always starts inside
  reasoning; R1-0528 repeats the tag, which is stripped.
* ``deepseek-v3`` (V3.1 hybrid): thinking is explicit. ``chat_template_kwargs.thinking`` (or its
  synonym ``enable_thinking``) true starts the output in reasoning; false turns parsing off. The
  V3.1 template also shows the choice in the prompt (``<think>`` vs ``</think>``), which wins.
"""

from __future__ import annotations

from llmkit.core.parsing.reasoning import ThinkTagReasoningParser


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    """DeepSeek-R1 and its distills: always reasoning first."""

    forces_reasoning = True


class DeepSeekV3ReasoningParser(ThinkTagReasoningParser):
    """DeepSeek-V3.1: reasoning only when the request turns thinking on."""

    thinking_kwarg = "force"
