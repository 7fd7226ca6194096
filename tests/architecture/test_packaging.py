"""Packaging: every package folder is listed in pyproject.toml and lands in the wheel as llmkit.*."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
MAPPING = {"core": "llmkit.core", "plugins": "llmkit.plugins", "cli": "llmkit.cli", "testing": "llmkit.testing"}


def _package_dirs() -> set[str]:
    found = set()
    for top, name in MAPPING.items():
        for init in (ROOT / top).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(ROOT / top)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    return found


def test_every_package_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert _package_dirs() == listed


def test_wheel_contains_every_module(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
    )
    wheel = next(tmp_path.glob("llmkit-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for top, name in MAPPING.items():
        for py in (ROOT / top).rglob("*.py"):
            if "__pycache__" in py.parts:
                continue
            arc = "/".join([*name.split("."), *py.relative_to(ROOT / top).parts])
            assert arc in names, arc
    assert not any(n.startswith(("core/", "plugins/", "cli/", "tests/")) for n in names)
    assert any(n.endswith("entry_points.txt") for n in names)
    # the web playground's static files ship inside the wheel
    for f in (ROOT / "core" / "server" / "web").iterdir():
        assert f"llmkit/core/server/web/{f.name}" in names, f.name
    # the native kernels' C sources and their shared header, compiled on first use
    for top, name in MAPPING.items():
        for c in [*(ROOT / top).rglob("*.c"), *(ROOT / top).rglob("*.h")]:
            assert "/".join([*name.split("."), *c.relative_to(ROOT / top).parts]) in names, c


def _named(name: str, requirements: list[str]) -> list[str]:
    return [r for r in requirements if re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0] == name]


def test_pytest_is_no_dependency_of_llmkit():
    """llmkit.testing imports pytest for a plugin's test suite; llmkit itself runs without it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not _named("pytest", project["dependencies"]) and _named("pytest", project["optional-dependencies"]["test"])


def test_triton_is_an_extra_that_the_test_extra_includes():
    """Only CUDA and the interpreter tests run Triton: a CPU install goes without its ~1 GB."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert not _named("triton", project["dependencies"])
    assert _named("triton", extras["triton"]) and _named("triton", extras["test"]) == _named("triton", extras["triton"])


def test_readme_test_line_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert "llmkit serve" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pytest" in readme and "grep" in ci and "README.md" in ci
