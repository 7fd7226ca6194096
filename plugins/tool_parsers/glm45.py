"""``glm45``: GLM-4.5, GLM-4.6 and GLM-4.7 tool calls, one block per call::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

(GLM-4.7 writes the same without the newlines.) The name is the text before the first
``<arg_key>``; a string value is written as is, any other as JSON (the chat template's
``tojson``), so values are typed by the request's schema, undeclared ones read as JSON where they
parse."""

from __future__ import annotations

import re

from llmkit.core.parsing.call_shape import ToolCallShape
from llmkit.plugins.tool_parsers._xml_block import BlockToolParser

_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm45ToolParser(BlockToolParser):
    """``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>``."""

    block_start, block_end = "<tool_call>", "</tool_call>"
    # strict calls (xgrammar's glm_xml arguments): the pairs typed by the tool's schema
    call_shape = ToolCallShape("<tool_call>", "<tool_call>{name}", "</tool_call>", "glm_xml")
    call_format = (
        "<tool_call><function-name>\n<arg_key><parameter-name></arg_key>\n<arg_value><value></arg_value>\n</tool_call>"
    )

    def calls_in(self, block: str):
        name = block.split("<arg_key>", 1)[0].strip()
        if not name or "<" in name or "\n" in name:
            return []
        return [(name, [(k.strip(), v) for k, v in _PAIR.findall(block)])]
