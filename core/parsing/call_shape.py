"""How a tool parser's model writes one call, declared by the parser so the grammar backend can
make every call the model opens parse and validate (strict tool calling for ``tool_choice: "auto"``).

Text stays free until ``trigger``; from there the call is ``begin`` (with the function's name),
the arguments in ``arguments``' encoding under the tool's schema, then ``end``. A parser whose
format has no such fixed frame (a running call index, bare JSON with no opening marker, pythonic
lists) declares none and its calls stay unconstrained.
"""

from __future__ import annotations

from dataclasses import dataclass

#: argument encodings, named as xgrammar's ``json_schema`` format ``style`` names them
ENCODINGS = ("json", "qwen_xml", "minimax_xml", "glm_xml", "deepseek_xml", "gemma")


@dataclass(frozen=True)
class ToolCallShape:
    """One call's frame: ``begin`` (``{name}`` stands for the function's name), arguments, ``end``.

    ``trigger`` is the text that opens every call: ``begin`` must start with it once the name is
    filled in, since the grammar lets free text run until it appears.
    """

    trigger: str
    begin: str
    end: str
    arguments: str = "json"

    def __post_init__(self) -> None:
        if self.arguments not in ENCODINGS:
            raise ValueError(f"unknown argument encoding {self.arguments!r}; valid: {', '.join(ENCODINGS)}")
        if not self.begin.startswith(self.trigger) or "{name}" not in self.begin:
            raise ValueError("begin must start with the trigger and name the function as {name}")

    def begin_for(self, name: str) -> str:
        """The opening text of a call to ``name``."""
        return self.begin.replace("{name}", name)
