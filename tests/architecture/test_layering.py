"""The import graph of core/ goes only downward, so each layer can be read (and replaced) alone.

kvcache -> model, parsing, grammar -> lora -> engine, embedding -> server -> batches -> refusals -> launch; plugins.py,
hookspecs.py, option.py,
native.py (the C-kernel builder) and own_thread.py sit under everything. Same-rank packages do not import each other; the server reaches the engine only
through its client protocol and its plain messages; core never imports a plugin or the CLI.
Function-local imports count too.

Inside a layer: no import circle between modules (a circle hidden behind a function-local import
is still one), and no folder holds more than ``BUDGET`` modules, so growth lands in a subfolder
named for its concern instead of behind a file-name prefix.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core"
TOPS = {"core": "llmkit.core", "plugins": "llmkit.plugins", "cli": "llmkit.cli"}
BUDGET = 15  # modules per folder, __init__.py not counted
RANK = {
    "hookspecs": 0,
    "option": 1.5,  # how a config field declares its serve option; the configs import it
    "native": 0,
    "own_thread": 0,
    "plugins": 1,
    "kvcache": 2,
    "multimodal": 2.5,  # image items, pixels to tokens: the engine, the server and model plugins share them
    "model": 3,
    "parsing": 3,
    "grammar": 3,
    "speculative": 3,
    "lora": 3.5,  # adapters over the model's linear layers; the engine serves them
    "engine": 4,
    "embedding": 4,  # encoders beside the generation engine, not in it
    "server": 5,
    "batches": 6,
    "refusals": 6.5,  # checks both configs (server keys, engine devices) before launch builds anything
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
    monkeypatch.setattr(sys.modules[__name__], "CORE", fake)
    found = _violations()
    assert any("upward" in v for v in found) and any("client and messages" in v for v in found)


# --- circles and folder budgets ---------------------------------------------------------------------


def _modules() -> dict[str, Path]:
    """Every module under core/, plugins/ and cli/ by its dotted name (packages by their own name)."""
    found = {}
    for top, name in TOPS.items():
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT / top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([name, *parts])] = path
    return found


def _import_graph() -> dict[str, set[str]]:
    """Module -> the llmkit modules it imports anywhere in its file (function bodies included);
    ``from pkg import name`` counts as importing ``pkg.name`` where that is a module."""
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        graph[mod] = {o for t in targets if t.startswith("llmkit.") and (o := owner(t)) and o != mod}
    return graph


def _circles() -> list[list[str]]:
    """The import circles (strongly connected components of more than one module), Tarjan's way."""
    graph = _import_graph()
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _over_budget() -> list[str]:
    bad = []
    for top in TOPS:
        for folder in sorted(p for p in (ROOT / top).rglob("*") if p.is_dir() and (p / "__init__.py").exists()):
            rel = folder.relative_to(ROOT).as_posix()
            n = sum(1 for f in folder.glob("*.py") if f.name != "__init__.py")
            if n > BUDGET:
                bad.append(f"{rel}/ holds {n} modules (budget {BUDGET}): split it by concern into subfolders")
    return bad


def test_no_import_circles():
    circles = _circles()
    assert circles == [], "import circles (function-local imports included):\n" + "\n".join(
        " <-> ".join(c) for c in circles
    )


def test_every_folder_keeps_to_its_module_budget():
    assert _over_budget() == []


def test_the_model_contract_imports_no_implementation():
    """causal_lm.py and attention.py, the contracts model and attention plugins implement, reach
    the layers and formats only through quantize.py (the walks the contract delegates to)."""
    allowed = {
        "llmkit.core.model.attention",
        "llmkit.core.model.causal_lm",
        "llmkit.core.model.parallel",
        "llmkit.core.model.quantize",
        "llmkit.core.kvcache.kv_pool",
    }
    graph = _import_graph()
    for contract in ("llmkit.core.model.causal_lm", "llmkit.core.model.attention"):
        assert graph[contract] <= allowed, (contract, graph[contract] - allowed)


def test_the_circle_and_budget_checks_see_violations(tmp_path, monkeypatch):
    """A circle closed by a function-local import, and a folder one module over budget, are caught
    and named."""
    for top in TOPS:
        (tmp_path / top).mkdir()
        (tmp_path / top / "__init__.py").write_text("")
    pkg = tmp_path / "core" / "thing"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from llmkit.core.thing import b\n")
    (pkg / "b.py").write_text("def f():\n    from llmkit.core.thing.a import x\n")
    for i in range(BUDGET - 2):  # with a.py and b.py: exactly the budget
        (pkg / f"m{i}.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _circles() == [["llmkit.core.thing.a", "llmkit.core.thing.b"]]
    assert _over_budget() == []
    (pkg / "one_more.py").write_text("")
    assert _over_budget() == [
        f"core/thing/ holds {BUDGET + 1} modules (budget {BUDGET}): split it by concern into subfolders"
    ]
