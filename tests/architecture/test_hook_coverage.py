"""datasette's habit: every hook has a test that exercises it and a line in the README."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

from llmkit.core import hookspecs

ROOT = Path(__file__).resolve().parents[2]
HOOKS = sorted(name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("llmkit_"))


def test_there_are_hooks():
    assert len(HOOKS) >= 7


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_in_the_readme(hook):
    assert f"`{hook}(" in (ROOT / "README.md").read_text(), f"document {hook} in the README's plugin table"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_exercised_by_a_test_plugin(hook):
    """A plugin under tests/ (not just llmkit's own) implements the hook."""
    me = Path(__file__).name
    users = [p for p in (ROOT / "tests").rglob("*.py") if p.name != me and f"def {hook}(" in p.read_text()]
    assert users, f"no test plugin implements {hook}: add one (see tests/plugins/llmkit_toy)"


def _class_refs(doc: str | None) -> list[str]:
    return re.findall(r":class:`~?([\w.]+)`", doc or "")


def _resolve(ref: str):
    module, _, attr = ref.rpartition(".")
    return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_names_the_class_to_subclass(hook):
    """A plugin author reads in the hook's docstring which class to subclass (and it exists)."""
    refs = _class_refs(getattr(hookspecs, hook).__doc__)
    assert refs, f"{hook}'s docstring names no class (:class:`...`)"
    for ref in refs:
        assert inspect.isclass(_resolve(ref)), ref


def test_every_test_kit_is_named_by_a_hook():
    """Each llmkit.testing contract class is named in the docstring of the hook whose plugins it
    checks, so an author finds it where they read what to subclass."""
    import llmkit.testing

    named = {ref for hook in HOOKS for ref in _class_refs(getattr(hookspecs, hook).__doc__)}
    kits = [
        f"{info.name}.{name}"
        for info in pkgutil.iter_modules(llmkit.testing.__path__, "llmkit.testing.")
        for name, obj in inspect.getmembers(importlib.import_module(info.name), inspect.isclass)
        if name.endswith("Contract") and obj.__module__ == info.name
    ]
    assert kits, "no kit found under llmkit.testing"
    assert sorted(set(kits) - named) == []
