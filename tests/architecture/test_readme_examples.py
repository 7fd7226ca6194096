"""The README's Python examples run as pasted on a first run: what they import is installed or its
``pip install`` said before them, and the ones under "Using it" cap their output (the embedded
model, uncapped, rambles on: a Responses call without ``max_output_tokens`` took 22.5 s)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = [(m.start(), ast.parse(m.group(1))) for m in re.finditer(r"```python\n(.*?)```", README, re.S)]
# The argument that caps a generating call, by the API it calls.
CAPS = {"responses": "max_output_tokens", "completions": "max_tokens", "messages": "max_tokens"}


def _imports(tree) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_every_imported_client_is_installed_or_its_pip_install_said_first():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    installed = {re.split(r"[<>=;\[ ]", d)[0] for d in deps} | set(sys.stdlib_module_names) | {"llmkit"}
    for start, tree in BLOCKS:
        for module in _imports(tree) - installed:
            assert f"pip install {module}" in README[:start], f"README imports {module} before saying to install it"


def test_using_it_examples_cap_their_output():
    start, end = README.index("\n## Using it"), README.index("\n## ", README.index("\n## Using it") + 1)
    calls = 0
    for _, tree in (b for b in BLOCKS if start < b[0] < end):
        for node in ast.walk(tree):
            api = _api(node)
            if api is not None:
                calls += 1
                assert CAPS[api] in {k.arg for k in node.keywords}, ast.unparse(node)
    assert calls >= 5


def _api(node) -> str | None:
    """``responses`` for ``client.responses.create(...)`` and so on; None for other nodes."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "create"):
        return None
    owner = node.func.value
    return owner.attr if isinstance(owner, ast.Attribute) and owner.attr in CAPS else None
