"""datasette's habit: every hook has a test that exercises it and a line in the README."""

from __future__ import annotations

import inspect
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
