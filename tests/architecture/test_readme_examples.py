"""The Python examples of the README and the docs pages run as pasted on a first run: what they
import is installed or its ``pip install`` said before them on the same page, and the ones that
call the embedded model (the README's "Using it", the getting-started and API pages) cap their
output (the embedded model, uncapped, rambles on: a Responses call without ``max_output_tokens``
took 22.5 s)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# The argument that caps a generating call, by the API it calls.
CAPS = {"responses": "max_output_tokens", "completions": "max_tokens", "messages": "max_tokens"}


def _blocks(text: str) -> list[tuple[int, ast.Module]]:
    return [(m.start(), ast.parse(m.group(1))) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


def _imports(tree) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.split(".")[0])
    return found


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_imported_client_is_installed_or_its_pip_install_said_first(page):
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    installed = {re.split(r"[<>=;\[ ]", d)[0] for d in deps} | set(sys.stdlib_module_names) | {"llmkit"}
    text = page.read_text()
    for start, tree in _blocks(text):
        for module in _imports(tree) - installed:
            assert f"pip install {module}" in text[:start], (
                f"{_name(page)} imports {module} before saying to install it"
            )


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


# Where the examples call the embedded model, and the fewest capped calls each shows.
EMBEDDED_MODEL_EXAMPLES = [
    ("README.md", "## Using it", 3),
    ("docs/getting-started.md", "## First request", 3),
    ("docs/api.md", None, 3),  # Responses, Anthropic Messages
]


@pytest.mark.parametrize(("page", "heading", "least"), EMBEDDED_MODEL_EXAMPLES, ids=lambda v: str(v))
def test_embedded_model_examples_cap_their_output(page, heading, least):
    text = (ROOT / page).read_text()
    if heading is not None:
        text = _section(text, heading)
    calls = 0
    for _, tree in _blocks(text):
        for node in ast.walk(tree):
            api = _api(node)
            if api is not None:
                calls += 1
                assert CAPS[api] in {k.arg for k in node.keywords}, ast.unparse(node)
    assert calls >= least


def _api(node) -> str | None:
    """``responses`` for ``client.responses.create(...)`` and so on; None for other nodes."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "create"):
        return None
    owner = node.func.value
    return owner.attr if isinstance(owner, ast.Attribute) and owner.attr in CAPS else None
