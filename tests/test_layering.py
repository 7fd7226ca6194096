"""The import graph of core/ goes only downward, so each layer can be read (and replaced) alone.

kvcache -> model, parsing, grammar -> engine -> server -> batches -> launch; plugins.py, hookspecs.py
and native.py (the C-kernel builder) sit under everything. Same-rank packages do not import each other; the server reaches the engine only
through its client protocol and its plain messages; core never imports a plugin or the CLI.
Function-local imports count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parent.parent / "core"
RANK = {
    "hookspecs": 0,
    "native": 0,
    "plugins": 1,
    "kvcache": 2,
    "model": 3,
    "parsing": 3,
    "grammar": 3,
    "engine": 4,
    "server": 5,
    "batches": 6,
    "launch": 7,
}
SERVER_MAY_USE = {"llmkit.core.engine.client", "llmkit.core.engine.messages"}


def _unit(module: str) -> str:
    """``llmkit.core.engine.loop`` -> ``engine``; ``llmkit.core.launch`` -> ``launch``."""
    return module.split(".")[2]


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "llmkit.core":  # from llmkit.core import hookspecs
                found += [(node.lineno, f"llmkit.core.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
    return found


def _violations() -> list[str]:
    bad = []
    for path in sorted(CORE.rglob("*.py")):
        rel = path.relative_to(CORE)
        if rel == Path("__init__.py"):
            continue  # lazy re-exports by name, not imports
        me = rel.parts[0].removesuffix(".py")
        for line, mod in _imports(path):
            where = f"core/{rel}:{line} imports {mod}"
            if mod.startswith(("llmkit.plugins", "llmkit.cli")):
                bad.append(f"{where} (core never imports plugins or the CLI)")
                continue
            if not mod.startswith("llmkit.core.") or _unit(mod) == me:
                continue
            other = _unit(mod)
            if RANK[other] > RANK[me]:
                bad.append(f"{where} (upward: {me} is below {other})")
            elif RANK[other] == RANK[me]:
                bad.append(f"{where} (sideways: {me} and {other} are peers)")
            elif me == "server" and other == "engine" and mod not in SERVER_MAY_USE:
                bad.append(f"{where} (the server uses the engine only through client and messages)")
    return bad


def test_every_core_package_has_a_rank():
    units = {
        p.name.removesuffix(".py")
        for p in CORE.iterdir()
        if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.name != "__init__.py")
    }
    assert units == set(RANK), f"give new packages a rank in RANK: {units ^ set(RANK)}"


def test_imports_only_go_down():
    assert _violations() == []


def test_the_checker_sees_violations(tmp_path, monkeypatch):
    """The rule is not vacuous: an upward import and a server->engine.loop import are caught."""
    fake = tmp_path / "core"
    (fake / "engine").mkdir(parents=True)
    (fake / "server").mkdir()
    (fake / "engine" / "x.py").write_text("def f():\n    from llmkit.core.server.app import create_app\n")
    (fake / "server" / "y.py").write_text("from llmkit.core.engine.loop import Engine\n")
    monkeypatch.setattr(__import__(__name__), "CORE", fake)
    found = _violations()
    assert any("upward" in v for v in found) and any("client and messages" in v for v in found)
