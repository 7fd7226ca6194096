"""``minimax_m2``: MiniMax-M2 tool calls, every call of a turn in one block::

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    <invoke name="get_time">
    </invoke>
    </minimax:tool_call>

A value is the text between its tags less one leading and one trailing newline, typed by the
request's schema (non-strings are JSON). An ``<invoke>`` cut off at the end of the output keeps the
parameters it closed."""

from __future__ import annotations

import re

from llmkit.core.parsing.call_shape import ToolCallShape
from llmkit.plugins.tool_parsers._xml_block import BlockToolParser

_INVOKE = re.compile(r'<invoke name="([^"]*)">(.*?)(?:</invoke>|$)', re.DOTALL)
_PARAM = re.compile(r'<parameter name="([^"]*)">(.*?)</parameter>', re.DOTALL)


def _trim(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class MiniMaxM2ToolParser(BlockToolParser):
    """``<minimax:tool_call><invoke name="N"><parameter name="K">V</parameter>…</invoke>…</minimax:tool_call>``."""

    block_start, block_end = "<minimax:tool_call>", "</minimax:tool_call>"
    # strict calls (xgrammar's minimax_xml arguments): one invoke a block, which the parser reads
    call_shape = ToolCallShape(
        "<minimax:tool_call>",
        '<minimax:tool_call>\n<invoke name="{name}">\n',
        "</invoke>\n</minimax:tool_call>",
        "minimax_xml",
    )
    call_format = (
        '<minimax:tool_call>\n<invoke name="<function-name>">\n<parameter name="<parameter-name>"><value></parameter>\n'
        "</invoke>\n</minimax:tool_call>"
    )

    def calls_in(self, block: str):
        return [
            (name.strip(), [(k.strip(), _trim(v)) for k, v in _PARAM.findall(body)])
            for name, body in _INVOKE.findall(block)
        ]
