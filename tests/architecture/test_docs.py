"""The README stays a front door and the docs site stays whole: the README is short, every page
under docs/ is in mkdocs.yml's nav (no orphan pages) and every nav entry exists, the sections that
pages include from the README are there, and CI builds the site with --strict."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README_MAX_LINES = 300


class _Loader(yaml.SafeLoader):
    """mkdocs.yml's own tags (``!relative``, ``!ENV``) read as plain values."""


_Loader.add_multi_constructor("!", lambda loader, suffix, node: None)


def _nav_pages(entry) -> list[str]:
    if isinstance(entry, str):
        return [entry]
    if isinstance(entry, list):
        return [p for e in entry for p in _nav_pages(e)]
    if isinstance(entry, dict):
        return [p for v in entry.values() for p in _nav_pages(v)]
    return []


def _config() -> dict:
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)


def test_readme_is_at_most_300_lines():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move text to a page under docs/"


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    config = _config()
    assert config.get("docs_dir", "docs") == "docs"
    nav = _nav_pages(config["nav"])
    assert len(nav) == len(set(nav)), "a page is listed twice in mkdocs.yml's nav"
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages - set(nav) == set(), "pages missing from mkdocs.yml's nav"
    assert set(nav) - pages == set(), "nav entries without a page"


def test_generated_reference_pages_are_in_the_nav():
    nav = _nav_pages(_config()["nav"])
    assert {"reference/serve-options.md", "reference/models.md"} <= set(nav)


def test_readme_sections_that_pages_include_exist():
    """A page's ``--8<-- "README.md:NAME"`` needs README's start and end markers of NAME."""
    readme = (ROOT / "README.md").read_text()
    included = {
        name for p in DOCS.rglob("*.md") for name in re.findall(r'--8<-- "README\.md:([a-z0-9_-]+)"', p.read_text())
    }
    assert included, "the pages include the README's plugin table, layout and benchmark tables"
    for name in included:
        start, end = f"<!-- --8<-- [start:{name}] -->", f"<!-- --8<-- [end:{name}] -->"
        assert start in readme and end in readme and readme.index(start) < readme.index(end), name


def test_docs_extra_is_in_the_test_extra_and_ci_builds_the_site_strictly():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"mkdocs", "mkdocs-material"} <= {re.split(r"[<>=!~;\[ ]", r)[0] for r in extras["docs"]}
    assert set(extras["docs"]) <= set(extras["test"])
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"-m mkdocs build --strict", ci)


def test_generated_reference_pages_equal_the_code():
    """docs/reference/ is generated from the option fields and the plugin registry: a hand edit, or
    a field changed without rerunning the generator, fails here. Each option's default, env var and
    allowed values in the docs are therefore the field's own."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, str(DOCS / "gen_reference.py"), "--check"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


def test_the_option_reference_lists_every_field_with_its_default():
    from dataclasses import MISSING

    from llmkit.core.engine.config import EngineConfig
    from llmkit.core.option import options
    from llmkit.core.server.config import ServerConfig

    page = (DOCS / "reference" / "serve-options.md").read_text()
    for cls in (EngineConfig, ServerConfig):
        for f, opt in options(cls):
            row = next((line for line in page.splitlines() if line.startswith(f"| `{opt.flag}`")), None)
            assert row is not None, opt.flag
            if f.default not in (None, MISSING, ()) and not isinstance(f.default, bool) and not opt.show_default:
                assert f"| `{f.default}` |" in row, (opt.flag, row)
