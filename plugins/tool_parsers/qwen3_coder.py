"""``qwen3_coder``: Qwen3-Coder, Qwen3.5 and Qwen3.6 XML tool calls.

Format (one block per call, possibly after some text)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value is the text between its tags less one leading and one trailing newline, typed by the
request's tool schema (:mod:`llmkit.core.parsing.arg_types`); the arguments are the JSON object of
the parameters in the order written. The call is committed when ``<function=NAME>`` names a
request tool. A parameter declared only as ``string`` streams as the model writes it (a file's
content can be long); other values are sent when they end.

What models get wrong is tolerated as vLLM's and SGLang's parsers tolerate it: a missing
``</parameter>`` (the next ``<parameter=``, ``</function>`` or ``</tool_call>`` ends the value), a
missing ``</function>`` or ``</tool_call>``, several functions in one block, ``<function=``
without ``<tool_call>`` (only for a request tool's name), output cut off inside a call (the
parameters written so far are kept, a partial closing tag is dropped, the object is closed). ``<tool_call>`` not followed by a known
function stays content, tags included. Text between parameters is not part of a call and is
dropped.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llmkit.core.parsing.arg_types import convert_value, is_plain_string, tool_param_types
from llmkit.core.parsing.call_shape import ToolCallShape
from llmkit.core.parsing.text_scan import partial_marker_len
from llmkit.core.parsing.tool_parser import StreamingToolParser

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
FN_START, FN_END = "<function=", "</function>"
P_START, P_END = "<parameter=", "</parameter>"
#: what ends a parameter's value (all but the first are a missing ``</parameter>``)
VALUE_ENDS = (P_END, P_START, FN_END, TOOL_END)
#: what may follow inside a function: a parameter, its end, or (tags missing) the block's end or a new call
BODY_MARKERS = (P_START, FN_END, TOOL_END, TOOL_START, FN_START)
_NAME = re.compile(r"[^<>\n]*")
_NAME_LIMIT = 256


def _escaped(text: str) -> str:
    """``text`` as the inside of a JSON string (per character, so pieces join to the whole)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class Qwen3CoderToolParser(StreamingToolParser):
    """``<tool_call><function=NAME><parameter=KEY>value</parameter>…</function></tool_call>``."""

    call_shape = ToolCallShape(TOOL_START, TOOL_START + "\n<function={name}>\n", "</function>\n" + TOOL_END, "qwen_xml")

    #: shown to models whose chat template cannot render tools (see core/server/prompts/tool_prompt.py)
    call_format = (
        "<tool_call>\n<function=<function-name>>\n<parameter=<parameter-name>>\n<value>\n"
        "</parameter>\n</function>\n</tool_call>"
    )

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._param_types = tool_param_types(self.tools)
        self._fn: dict[str, frozenset[str] | None] = {}
        self._bare = False  # the block began with <function= (no <tool_call>)
        self._nparams = 0
        self._key = ""
        self._streamed = False  # the current value streams as a JSON string
        self._hits: dict[str, int] = {}  # where each marker was last found (a call has many)

    def _append(self, text: str) -> None:
        before = self._pos
        super()._append(text)
        if self._pos != before:  # the buffer was compacted
            self._hits = {m: i - (before - self._pos) for m, i in self._hits.items()}

    def _first(self, markers: tuple[str, ...]) -> tuple[int, str | None]:
        """The earliest marker at or after the cursor; a found one is not searched for again
        until the cursor passes it, so many parameters in one buffer cost linear time."""
        best, which = -1, None
        for m in markers:
            i = self._hits.get(m, -1)
            if i < self._pos:
                i = self._find(m)
                if i >= 0:
                    self._hits[m] = i
            if i >= 0 and (which is None or i < best):
                best, which = i, m
        return best, which

    def _step(self) -> bool:
        st = self._state
        if st == "text":
            i, m = self._content_until((TOOL_START, FN_START))
            if m is None:
                return False
            self._hold(i)
            self._bare = m == FN_START
            return self._to("name" if self._bare else "open")
        if st == "open":  # after <tool_call>: the function header must follow
            if not self._skip_ws():
                return self._final and self._fail()
            at = self._eat(FN_START)
            if at is None:
                return False
            return self._to("name") if at else self._fail()
        if st == "name":
            name = self._header_name()
            if name is None:
                return False
            if not name or not self.name_ok(name) or (self._bare and name not in self.tool_names):
                return self._fail()
            self._open_call(name)
            self._fn = self._param_types.get(name, {})
            self._nparams = 0
            return self._to("body")
        if st == "body":
            return self._body()
        if st == "key":
            key = self._header_name()
            if key is None:
                return False
            if not key:  # a malformed header: skip it, keep reading the call
                return self._to("body")
            types = self._fn.get(key)
            self._key, self._streamed = key, is_plain_string(types)
            if self._streamed:
                self._add_args(self._sep() + json.dumps(key, ensure_ascii=False) + ': "')
            return self._to("value0")
        if st == "value0":  # one newline after the tag is layout, not value
            if self._pos >= len(self._buf):
                if not self._final:
                    return False
            elif self._buf[self._pos] == "\n":
                self._pos += 1
            return self._to("value")
        if st == "value":
            return self._value()
        # "after": </function> was read; another function in the same block, or </tool_call>
        if not self._skip_ws() and not self._final:
            return False
        at = self._at(FN_START)
        if at:
            return self._function_in_block(self._pos)
        at = at if at is None else self._eat(TOOL_END)
        if at is None:
            return False
        return self._to("text")

    def _function_in_block(self, at: int) -> bool:
        """``<function=`` at ``at`` inside a ``<tool_call>`` block: read it as a wrapped call."""
        self._hold(at)
        self._pos = at + len(FN_START)
        self._bare = False
        return self._to("name")

    def _header_name(self) -> str | None:
        """Read ``NAME>`` at the cursor: the stripped name ("" when malformed), None to wait."""
        end = _NAME.match(self._buf, self._pos).end()
        if end == len(self._buf) and not self._final and end - self._pos <= _NAME_LIMIT:
            return None
        if not self._buf.startswith(">", end):
            return ""
        name = self._buf[self._pos : end].strip()
        self._pos = end + 1
        return name

    def _sep(self) -> str:
        self._nparams += 1
        return "{" if self._nparams == 1 else ", "

    def _end_call(self) -> None:
        if self._nparams:
            self._add_args("}")
        self._close_call()

    def _body(self) -> bool:
        """Inside a function, between parameters: find what comes next (other text is dropped)."""
        i, m = self._first(BODY_MARKERS)
        if m is None:
            self._pos = len(self._buf) - (0 if self._final else partial_marker_len(self._buf, BODY_MARKERS, self._pos))
            if self._final:
                self._end_call()
                return self._to("text")
            return False
        self._pos = i
        if m == P_START:
            self._pos += len(m)
            return self._to("key")
        self._end_call()
        if m == FN_END:
            self._pos += len(m)
            return self._to("after")
        if m == FN_START:  # the next function of the block: this one lacked </function>
            return self._function_in_block(i)
        if m == TOOL_END:
            self._pos += len(m)
        return self._to("text")  # a new block begins here: the last one lacked its closing tags

    def _value(self) -> bool:
        buf, pos = self._buf, self._pos
        end, m = self._first(VALUE_ENDS)
        if m is None and self._final:  # cut off: the value is what was written, less a partial closing tag
            end = len(buf) - partial_marker_len(buf, VALUE_ENDS, pos)
        elif m is None:
            if self._streamed:  # send what cannot be the end yet (a last newline may be layout)
                safe = len(buf) - partial_marker_len(buf, VALUE_ENDS, pos)
                if safe > pos and buf[safe - 1] == "\n":
                    safe -= 1
                self._add_args(_escaped(buf[pos:safe]))
                self._pos = safe
            return False  # a buffered value waits at its start; _find does not rescan
        stop = end - 1 if end > pos and buf[end - 1] == "\n" else end
        raw = buf[pos:stop]
        if self._streamed:
            self._add_args(_escaped(raw) + '"')
        else:
            value = convert_value(raw, self._fn.get(self._key))
            self._add_args(
                self._sep() + json.dumps(self._key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
            )
        self._pos = len(buf) if m is None else end + (len(P_END) if m == P_END else 0)
        return self._to("body")
