"""``gemma4``: Gemma 4's thought channel, ``<|channel>thought\\n`` … ``<channel|>``, then the answer.

The model opens the channel itself when thinking is on (the template's ``enable_thinking`` puts
``<|think|>`` in the system turn; larger models may write an empty channel with it off), so only a
reply that starts with the channel has reasoning. The markers are special tokens: they are kept
through detokenization. A ``<|tool_call>`` inside the channel ends it, the call going to content
where the tool parser finds it.
"""

from __future__ import annotations

from llmkit.core.parsing.reasoning import ThinkTagReasoningParser


class Gemma4ReasoningParser(ThinkTagReasoningParser):
    start_tag = "<|channel>thought"
    end_tag = "<channel|>"
    keep_special_tokens = True
    tool_start = "<|tool_call>"
