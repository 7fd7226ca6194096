"""The plugin manager and a typed facade over it.

Plugins come from the ``llmkit`` entry-point group; llmkit's own plugins are registered there exactly
like third-party ones. Loading is lazy and happens once per process. ``LLMKIT_DISABLE_PLUGIN_AUTOLOAD=1``
loads only the plugins shipped with llmkit.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import pluggy

from llmkit.core import hookspecs

ENTRY_POINT_GROUP = "llmkit"
KINDS = {
    "attention": "llmkit_register_attention_backends",
    "model": "llmkit_register_models",
    "reasoning_parser": "llmkit_register_reasoning_parsers",
    "tool_parser": "llmkit_register_tool_parsers",
    "storage": "llmkit_register_storage_backends",
    "grammar": "llmkit_register_grammar_backends",
    "speculative_algorithm": "llmkit_register_speculative_algorithms",
    "lora_resolver": "llmkit_register_lora_resolvers",
    "kv_storage": "llmkit_register_kv_storage",
}


class PluginError(Exception):
    """A plugin could not be found, loaded or registered."""


@dataclass(frozen=True)
class PluginEntry:
    kind: str
    name: str
    factory: str | Callable[..., Any]
    plugin: str
    package: str
    version: str
    # What the plugin declares about itself at registration (read without importing it), e.g.
    # ``auto={"cuda": 10}`` for attention, ``model_types=("llama",)`` for models.
    meta: dict = field(default_factory=dict, compare=False)

    def load(self) -> Any:
        """Resolve the factory; a ``"module:attr"`` string is imported now."""
        if not isinstance(self.factory, str):
            return self.factory
        module, _, attr = self.factory.partition(":")
        try:
            obj = importlib.import_module(module)
        except ImportError as exc:
            raise PluginError(
                f"{self.kind} '{self.name}' (from {self.package}) needs a missing dependency: {exc}"
            ) from exc
        for part in attr.split(".") if attr else []:
            obj = getattr(obj, part)
        return obj


class Registry:
    """Everything the plugins registered, by kind and name."""

    def __init__(self, pm: pluggy.PluginManager, origins: dict[str, tuple[str, str]]):
        self._entries: dict[str, dict[str, PluginEntry]] = {k: {} for k in KINDS}
        for kind, hook_name in KINDS.items():
            caller = getattr(pm.hook, hook_name)
            for impl in reversed(caller.get_hookimpls()):
                package, version = origins.get(impl.plugin_name, (impl.plugin_name, ""))
                impl.function(register=self._registrar(kind, impl.plugin_name, package, version))

    def _registrar(self, kind: str, plugin: str, package: str, version: str):
        def register(name: str, factory: str | Callable[..., Any], **meta: Any) -> None:
            existing = self._entries[kind].get(name)
            if existing is not None:
                raise PluginError(
                    f"{kind} '{name}' is registered twice: by {existing.plugin} "
                    f"({existing.package}) and by {plugin} ({package})"
                )
            self._entries[kind][name] = PluginEntry(kind, name, factory, plugin, package, version, meta)

        return register

    def names(self, kind: str) -> list[str]:
        return sorted(self._entries[kind])

    def entries(self) -> list[PluginEntry]:
        return [e for kind in KINDS for e in sorted(self._entries[kind].values(), key=lambda e: e.name)]

    def entry(self, kind: str, name: str) -> PluginEntry:
        try:
            return self._entries[kind][name]
        except KeyError:
            valid = ", ".join(self.names(kind)) or "(none registered)"
            raise PluginError(f"unknown {kind.replace('_', ' ')} '{name}'; valid names: {valid}") from None

    def _load(self, kind: str, name: str) -> Any:
        return self.entry(kind, name).load()

    # One lookup per kind: the loaded factory registered under ``name``, or a PluginError that
    # lists the valid names.
    def attention_backend(self, name: str) -> Any:
        return self._load("attention", name)

    def model(self, architecture: str) -> Any:
        if architecture not in self._entries["model"]:
            import difflib

            # compared without the class suffix every causal LM shares
            stem = {
                n.removesuffix("ForCausalLM"): n
                for n, e in self._entries["model"].items()
                if not e.meta.get("embedding")
            }
            close = difflib.get_close_matches(architecture.removesuffix("ForCausalLM"), list(stem), n=1, cutoff=0.5)
            near = [stem[c] for c in close]
            raise PluginError(
                f"architecture '{architecture}' is not served by llmkit"
                + (f" (nearest supported: {near[0]})" if near else "")
                + "; `llmkit plugins` lists the supported ones"
            )
        return self._load("model", architecture)

    def reasoning_parser(self, name: str) -> Any:
        return self._load("reasoning_parser", name)

    def tool_parser(self, name: str) -> Any:
        return self._load("tool_parser", name)

    def storage_backend(self, name: str) -> Any:
        return self._load("storage", name)

    def grammar_backend(self, name: str) -> Any:
        return self._load("grammar", name)

    def speculative_algorithm(self, name: str) -> Any:
        return self._load("speculative_algorithm", name)

    def lora_resolver(self, name: str) -> Any:
        return self._load("lora_resolver", name)

    def kv_storage(self, name: str) -> Any:
        return self._load("kv_storage", name)

    def default(self, kind: str) -> str:
        """The one plugin of ``kind`` registered with ``default=True`` (grammar, storage, kv_storage)."""
        found = [e.name for e in self._entries[kind].values() if e.meta.get("default")]
        if len(found) != 1:
            raise PluginError(
                f"expected one default {kind.replace('_', ' ')} plugin, found {found or 'none'}; "
                f"name one explicitly (valid names: {', '.join(self.names(kind))})"
            )
        return found[0]

    def auto_attention(self, device_type: str) -> list[str]:
        """Attention backends that declared ``auto={device_type: rank}``, best (highest) first."""
        ranked = [(e.meta.get("auto", {}).get(device_type), e.name) for e in self._entries["attention"].values()]
        return [name for rank, name in sorted((r for r in ranked if r[0] is not None), key=lambda r: -r[0])]

    def architecture_for_model_type(self, model_type: str) -> str | None:
        """The model plugin that declared ``model_types`` containing ``model_type``."""
        for e in self._entries["model"].values():
            if model_type in e.meta.get("model_types", ()):
                return e.name
        return None


_lock = threading.Lock()
_pm: pluggy.PluginManager | None = None
_origins: dict[str, tuple[str, str]] = {}
_registry: Registry | None = None


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, with entry points loaded (once)."""
    global _pm
    with _lock:
        if _pm is None:
            pm = pluggy.PluginManager("llmkit")
            pm.add_hookspecs(hookspecs)
            _load_entry_points(pm)
            pm.check_pending()
            _pm = pm
        return _pm


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    builtin_only = os.environ.get("LLMKIT_DISABLE_PLUGIN_AUTOLOAD", "") not in ("", "0")
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist
        package = dist.metadata["Name"] if dist is not None else "?"
        if builtin_only and package != "llmkit":
            continue
        name = f"{package}:{ep.name}"
        if pm.has_plugin(name):
            continue  # the same distribution seen twice on sys.path
        try:
            module = ep.load()
        except Exception as exc:  # a broken third-party plugin must say who it is
            raise PluginError(f"plugin {name} failed to load: {exc}") from exc
        pm.register(module, name=name)
        _origins[name] = (package, dist.version if dist is not None else "")


def registry() -> Registry:
    """The registry of every plugin's registrations, built once per process."""
    global _registry
    pm = get_plugin_manager()
    with _lock:
        if _registry is None:
            _registry = Registry(pm, dict(_origins))
        return _registry
