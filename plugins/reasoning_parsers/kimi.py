"""Kimi reasoning parser: ``◁think▷`` … ``◁/think▷``.

Kimi thinking models write the start tag themselves, so reasoning needs an explicit start tag at the
beginning of the output (or a prompt that ends with one); otherwise everything is content.
"""

from __future__ import annotations

from llmkit.core.parsing.reasoning import ThinkTagReasoningParser


class KimiReasoningParser(ThinkTagReasoningParser):
    """Kimi (``◁think▷``): never forced."""

    start_tag = "◁think▷"
    end_tag = "◁/think▷"
