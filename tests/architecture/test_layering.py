"""The import graph of core/ goes only downward, so each layer can be read (and replaced) alone.

kvcache -> model, parsing, grammar -> lora -> engine, embedding -> server -> batches -> refusals -> launch; plugins.py,
hookspecs.py, option.py,
native.py (the C-kernel builder) and own_thread.py sit under everything. Same-rank packages do not import each other; the server reaches the engine only
through its client protocol and its plain messages; core never imports a plugin, the CLI or llmkit.testing.
Function-local imports count too.

Inside a layer: no import circle between modules (a circle hidden behind a function-local import
is still one), and no folder holds more than ``BUDGET`` modules, so growth lands in a subfolder
named for its concern instead of behind a file-name prefix.

Plugin packages stand alone: plugins/<pkg>/ imports llmkit.core and llmkit.plugins.<pkg> only (what
two of them share moves to core), and inside plugins/models/ a family's module imports no other
family's (the shared stacks are core's). The Engine's private names are used in its own module only
(core/engine/loop.py); everything else, benchmarks included, calls its public methods. The
test kits (testing/, llmkit.testing) import llmkit.core only (a kit gets a built-in plugin through
the registry), and nothing llmkit runs (core/, plugins/, cli/) imports them or pytest.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core"
TOPS = {"core": "llmkit.core", "plugins": "llmkit.plugins", "cli": "llmkit.cli", "testing": "llmkit.testing"}
BUDGET = 15  # modules per folder, __init__.py not counted
RANK = {
    "hookspecs": 0,
    "option": 1.5,  # how a config field declares its serve option; the configs import it
    "native": 0,
    "own_thread": 0,
    "plugins": 1,
    "kvcache": 2,
    "multimodal": 2.5,  # image items, pixels to tokens: the engine, the server and model plugins share them
    "audio": 2.5,  # uploads to samples to log-mel features: the server and the speech models share them
    "model": 3,
    "parsing": 3,
    "grammar": 3,
    "speculative": 3,
    "lora": 3.5,  # adapters over the model's linear layers; the engine serves them
    "engine": 4,
    "embedding": 4,  # encoders beside the generation engine, not in it
    "speech": 4,  # speech-to-text models beside the generation engine, until the engine serves them
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
            if mod.startswith(("llmkit.plugins", "llmkit.cli", "llmkit.testing")):
                bad.append(f"{where} (core never imports plugins, the CLI or the test kits)")
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


# --- plugin packages stand alone ----------------------------------------------------------------------


def _imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """Every module ``path`` imports anywhere in its file (function bodies included), relative
    imports resolved against ``package`` (the dotted package the file is in); ``from a import b``
    counts as importing ``a.b`` (b may be a module)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return found


def _plugin_violations() -> list[str]:
    """A module under plugins/<pkg>/ imports llmkit.core.* and llmkit.plugins.<pkg>.* only: never
    another plugin package, the CLI or llmkit.testing (a module directly in plugins/ is its own
    package)."""
    plugins, bad = ROOT / "plugins", []
    for path in sorted(plugins.rglob("*.py")):
        rel = path.relative_to(plugins)
        if rel == Path("__init__.py"):
            continue
        own = f"llmkit.plugins.{rel.parts[0].removesuffix('.py')}"
        package = ".".join(["llmkit", "plugins", *rel.parent.parts])
        for line, mod in sorted(_imported_modules(path, package)):
            if mod.startswith("llmkit.") and not mod.startswith(("llmkit.core.", own + ".")) and mod != own:
                bad.append(
                    f"plugins/{rel.as_posix()}:{line} imports {mod} (a plugin imports only llmkit.core and {own})"
                )
    return bad


def test_plugin_packages_import_only_core_and_themselves():
    """What two plugin packages share lives in core (the decoder stacks in core/model/decoder/), so
    each package can be replaced, or shipped apart, alone."""
    assert _plugin_violations() == []


def test_the_plugin_check_sees_violations(tmp_path, monkeypatch):
    """A function-local import of another plugin package, a ``from llmkit.plugins import`` of one,
    and a relative import out of the package are caught; core and the package itself are not."""
    pkg = tmp_path / "plugins" / "speculative"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "ok.py").write_text(
        "from llmkit.core.model.layers import RMSNorm\nfrom llmkit.plugins.speculative import draft_cache\n"
        "from . import head_files\n"
    )
    (pkg / "bad.py").write_text(
        "def f():\n    from llmkit.plugins.models.deepseek_v3 import DecoderLayer\n"
        "from llmkit.plugins import models\nfrom ..attention import torch_backend\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _plugin_violations() == [
        f"plugins/speculative/bad.py:{line} imports {mod} (a plugin imports only llmkit.core and llmkit.plugins.speculative)"
        for line, mod in [
            (2, "llmkit.plugins.models.deepseek_v3.DecoderLayer"),
            (3, "llmkit.plugins.models"),
            (4, "llmkit.plugins.attention.torch_backend"),
        ]
    ]


# Model plugins reuse one another only through core (core/model/decoder/, the shared stacks, the
# Qwen-VL and Gemma 3 parts): a family's module imports no other family's.


def _model_module_edges() -> set[tuple[str, str]]:
    """``(file, module)``: a module under plugins/models/ importing another model module there."""
    models, edges = ROOT / "plugins" / "models", set()
    for path in sorted(models.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        rel = path.relative_to(ROOT / "plugins")
        package = ".".join(["llmkit", "plugins", *rel.parent.parts])
        me = ".".join(["llmkit", "plugins", *rel.with_suffix("").parts])
        for _, mod in _imported_modules(path, package):
            if not mod.startswith("llmkit.plugins.models."):
                continue
            parts = mod.split(".")[2:]  # the module the name lives in: the longest prefix that is a file
            while parts and not (ROOT / "plugins" / Path(*parts)).with_suffix(".py").exists():
                parts.pop()
            target = ".".join(["llmkit", "plugins", *parts])
            if parts and target != me:
                edges.add((path.relative_to(ROOT).as_posix(), target))
    return edges


def test_model_plugins_import_no_other_model_module():
    """What two model families share lives in core (a third-party model builds on the same
    stacks without importing llmkit's own plugins)."""
    assert _model_module_edges() == set()


def test_the_model_module_check_sees_violations(tmp_path, monkeypatch):
    models = tmp_path / "plugins" / "models"
    (models / "dense").mkdir(parents=True)
    (models / "llama.py").write_text("")
    (models / "dense" / "mistral.py").write_text(
        "from llmkit.core.model.decoder.stack import DecoderLM\n"
        "def f():\n    from llmkit.plugins.models.llama import LlamaForCausalLM\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _model_module_edges() == {("plugins/models/dense/mistral.py", "llmkit.plugins.models.llama")}


# --- the test kits -------------------------------------------------------------------------------------


def _kit_violations() -> list[str]:
    """testing/ (llmkit.testing) imports llmkit.core only; core/, plugins/ and cli/ import neither
    llmkit.testing nor pytest (the kits' dependency, not llmkit's)."""
    bad = []
    for top, name in TOPS.items():
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            package = ".".join([name, *path.relative_to(ROOT / top).parent.parts])
            for line, mod in sorted(_imported_modules(path, package)):
                if top == "testing" and mod.startswith("llmkit.") and not mod.startswith(("llmkit.core.", name)):
                    bad.append(f"{rel.as_posix()}:{line} imports {mod} (the kits import llmkit.core only)")
                elif top != "testing" and (mod.startswith("llmkit.testing") or mod.split(".")[0] == "pytest"):
                    bad.append(f"{rel.as_posix()}:{line} imports {mod} (llmkit does not run the test kits)")
    return bad


def test_the_test_kits_import_core_only_and_nothing_imports_them():
    assert _kit_violations() == []


def test_the_kit_check_sees_violations(tmp_path, monkeypatch):
    for top in TOPS:
        (tmp_path / top).mkdir()
    (tmp_path / "testing" / "attention.py").write_text(
        "import pytest\nfrom llmkit.core.plugins import registry\nfrom llmkit.testing import storage\n"
        "def f():\n    from llmkit.plugins.attention.torch_backend import TorchAttentionBackend\n"
    )
    (tmp_path / "plugins" / "x.py").write_text("def f():\n    import pytest\n")
    (tmp_path / "cli" / "y.py").write_text("from llmkit.testing.storage import StorageContract\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _kit_violations() == [
        "plugins/x.py:2 imports pytest (llmkit does not run the test kits)",
        "cli/y.py:1 imports llmkit.testing.storage.StorageContract (llmkit does not run the test kits)",
        "testing/attention.py:5 imports llmkit.plugins.attention.torch_backend.TorchAttentionBackend "
        "(the kits import llmkit.core only)",
    ]


# --- the Engine's privates stay in the engine loop ------------------------------------------------------

# The code that drives an engine: the packages and the benchmarks. Tests are left out: a white-box
# test may patch a private (tests/engine/test_gpu_defaults.py counts _launch_chained's launches).
ENGINE_USERS = ("core", "plugins", "cli", "testing", "benchmarks")
# the calls that name an attribute by a string: getattr(obj, "_x"), monkeypatch.setattr(obj, "_x", f)
BY_NAME = {"getattr", "setattr", "hasattr", "delattr"}


def _engine_class() -> tuple[Path, ast.ClassDef]:
    """The file under core/engine/ that defines ``class Engine``, and that class."""
    found = [
        (path, node)
        for path in sorted((ROOT / "core" / "engine").rglob("*.py"))
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ClassDef) and node.name == "Engine"
    ]
    assert len(found) == 1, f"expected one class Engine under core/engine/, found {len(found)}"
    return found[0]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_privates(cls: ast.ClassDef) -> set[str]:
    """The private names a class body defines: its methods and class attributes, and every
    ``self._x`` its methods assign."""
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return {n for n in names if _private(n)}


def _annotation_names(annotation) -> set[str]:
    """The class names an annotation mentions (``"Engine | None"`` -> {"Engine", "None"})."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval")
        except SyntaxError:
            return set()
    names = set()
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
    return names


def _bindings(body: list, scope: dict[str, set[str]], built_by) -> None:
    """Add to ``scope`` the classes each name of one scope (not the functions or classes nested in
    it) is bound to by an annotation or by ``name = Cls(...)``; ``built_by(value)`` names the class
    a value was built by ("?": unknown)."""
    stack = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    scope.setdefault(target.id, set()).add(built_by(node.value))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            scope.setdefault(node.target.id, set()).update(_annotation_names(node.annotation))
        stack += [
            c
            for c in ast.iter_child_nodes(node)
            if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef))
        ]


class _EngineAccess(ast.NodeVisitor):
    """Collects uses of ``privates`` (Engine's) on a receiver that may be an Engine: ``x._name``,
    and ``getattr``/``setattr``/``hasattr``/``delattr`` (``monkeypatch.setattr`` too) of ``"_name"``.

    A use passes as another class's own where the code sits in a class body (not one derived
    from Engine) that defines ``_name`` itself: Python's privacy is the class's, whatever the
    receiver. It passes too where the receiver is known to be another class's object: ``self`` or
    ``cls`` in a method of a class not derived from Engine, a name annotated with other classes,
    or one bound to ``Cls(...)`` of another class. Anything else (an Engine, or an unannotated
    ``engine`` parameter) is reported: annotate the receiver where it is not an Engine."""

    def __init__(self, privates: set[str], engine_names: set[str]) -> None:
        self.privates, self.engine_names = privates, set(engine_names)
        self.frames: list[tuple[str, object]] = []  # ("class", (name, derived, privates)) or ("scope", bindings)
        self.found: list[tuple[int, str]] = []

    def _lookup(self, name: str) -> set[str]:
        for kind, scope in reversed(self.frames):
            if kind == "scope" and name in scope:
                return scope[name]
        return {"?"}

    def _built_by(self, value) -> str:
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
            name = value.func.id
            if name == "cls":
                bound = self._lookup("cls")
                return next(iter(bound)) if len(bound) == 1 else "?"
            if name[:1].isupper():
                return name
        return "?"

    def visit_Module(self, node: ast.Module) -> None:
        scope: dict[str, set[str]] = {}
        self.frames.append(("scope", scope))
        _bindings(node.body, scope, self._built_by)
        self.generic_visit(node)
        self.frames.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        derived = bool(set().union(*(_annotation_names(b) for b in node.bases)) & self.engine_names)
        if derived:
            self.engine_names.add(node.name)  # its objects are Engines too
        self.frames.append(("class", (node.name, derived, _defined_privates(node))))
        self.generic_visit(node)
        self.frames.pop()

    def _scope(self, node) -> None:
        method = bool(self.frames) and self.frames[-1][0] == "class" and not isinstance(node, ast.Lambda)
        args = node.args
        params = [a for a in (*args.posonlyargs, *args.args, args.vararg, *args.kwonlyargs, args.kwarg) if a]
        scope: dict[str, set[str]] = {}
        for i, arg in enumerate(params):
            if arg.annotation is not None:
                scope[arg.arg] = _annotation_names(arg.annotation)
            elif method and i == 0 and arg.arg in ("self", "cls"):
                scope[arg.arg] = {self.frames[-1][1][0]}  # the class the method is in
            else:
                scope[arg.arg] = {"?"}
        self.frames.append(("scope", scope))
        _bindings(node.body if isinstance(node.body, list) else [node.body], scope, self._built_by)
        self.generic_visit(node)
        self.frames.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _scope

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in self.privates:
            self._check(node.lineno, node.value, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name in BY_NAME and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            if node.args[1].value in self.privates:
                self._check(node.lineno, node.args[0], node.args[1].value)
        self.generic_visit(node)

    def _check(self, line: int, receiver, attr: str) -> None:
        classes = [info for kind, info in self.frames if kind == "class"]
        if any(attr in own and not derived for _, derived, own in classes):
            return  # in a class that defines the same private: its own
        if isinstance(receiver, ast.Name) and receiver.id not in self.engine_names:
            bound = self._lookup(receiver.id)
            if "?" not in bound and not bound & self.engine_names:
                return  # known to be another class's object
        self.found.append((line, f"{ast.unparse(receiver)}.{attr}"))


def _engine_private_uses() -> list[str]:
    """Where code outside the Engine's own module uses one of its private names (see
    :class:`_EngineAccess`)."""
    own, cls = _engine_class()
    privates = _defined_privates(cls)
    bad = []
    for top in ENGINE_USERS:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == own:
                continue
            tree = ast.parse(path.read_text())
            aliases = {a.asname for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
            visitor = _EngineAccess(privates, {"Engine"} | {a for a in aliases if a and "Engine" in a})
            visitor.visit(tree)
            rel, home = path.relative_to(ROOT).as_posix(), own.relative_to(ROOT).as_posix()
            bad += [f"{rel}:{line} uses {what} (private to the Engine, in {home})" for line, what in visitor.found]
    return bad


def test_nothing_outside_the_engine_loop_uses_an_engine_private():
    """What other modules need of the Engine is its public methods (add, drain, has_work, fail,
    append_token, step, ...): its private state and steps can change without them."""
    assert _engine_private_uses() == []


def test_the_engine_check_sees_violations(tmp_path, monkeypatch):
    """Uses of Engine privates through an unannotated ``engine`` parameter, an annotated one, a
    local built by ``Engine(...)``, an Engine subclass's ``self``, a lambda and ``setattr`` by name
    are caught; the same names used as another class's own (a class defining them, an object
    annotated or built as another class) and public ones are not."""
    (tmp_path / "core" / "engine").mkdir(parents=True)
    (tmp_path / "core" / "engine" / "loop.py").write_text(
        "class Engine:\n"
        "    def __init__(self):\n        self._inbox = []\n        self.steps = 0\n"
        "    def _fail(self, req, message):\n        self._inbox.clear()\n"
        "    def fail(self, req, message):\n        self._fail(req, message)\n"
    )
    (tmp_path / "core" / "speculative").mkdir()
    (tmp_path / "core" / "speculative" / "bad.py").write_text(
        "from llmkit.core.engine.loop import Engine\n"
        "def verify(engine, req):\n    engine._fail(req, 'x')\n"  # 3
        "def typed(eng: 'Engine | None'):\n    return eng._inbox\n"  # 5
        "def built():\n    e = Engine()\n    e._inbox.append(1)\n"  # 8
        "class Mine(Engine):\n    def go(self):\n        self._fail(None, 'x')\n"  # 11
        "hook = lambda engine: engine._fail(None, 'y')\n"  # 12
        "def patch(engine, monkeypatch):\n    monkeypatch.setattr(engine, '_fail', print)\n"  # 14
    )
    (tmp_path / "core" / "speculative" / "fine.py").write_text(
        "import threading\n"
        "class Queue:\n    def __init__(self):\n        self._inbox = []\n"
        "    @classmethod\n    def make(cls):\n        q = cls()\n        return q._inbox, (lambda other: other._inbox)\n"
        "def read(q: Queue):\n    return q._inbox\n"
        "def fresh():\n    q = Queue()\n    return q._inbox\n"
        "def public(engine):\n    engine.fail(None, 'z')\n    return engine.steps\n"
    )
    for top in ENGINE_USERS:
        (tmp_path / top).mkdir(exist_ok=True)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = _engine_private_uses()
    home = "(private to the Engine, in core/engine/loop.py)"
    assert found == [
        f"core/speculative/bad.py:{line} uses {what} {home}"
        for line, what in [
            (3, "engine._fail"),
            (5, "eng._inbox"),
            (8, "e._inbox"),
            (11, "self._fail"),
            (12, "engine._fail"),
            (14, "engine._fail"),
        ]
    ]
