"""The C kernels build on first use into a cache, and every way of not having them falls back."""

from __future__ import annotations

import pytest

from llmkit.core import native
from llmkit.plugins.attention import cpu_attention

HAVE_CC = native._compiler() is not None and native.cpu_has("avx2")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMKIT_CACHE_DIR", str(tmp_path))
    native._build.cache_clear()
    yield tmp_path
    native._build.cache_clear()


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler or no AVX2 here")
def test_builds_once_into_the_cache(fresh):
    lib = native.load(cpu_attention._SOURCE)
    assert lib is not None and hasattr(lib, "paged_attention")
    built = list((fresh / "native").glob("cpu_attention-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    native._build.cache_clear()
    assert native.load(cpu_attention._SOURCE) is not None
    assert built[0].stat().st_mtime_ns == stamp  # loaded from the cache, not rebuilt
    assert [p.name for p in (fresh / "native").iterdir()] == [built[0].name]  # no temporary left


def test_no_compiler_means_no_kernel(fresh, monkeypatch):
    monkeypatch.setenv("CC", str(fresh / "no-such-cc"))
    assert native.load(cpu_attention._SOURCE) is None


def test_a_failing_build_means_no_kernel(fresh, monkeypatch, tmp_path):
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\n[ "$1" = --version ] && echo fake-cc && exit 0\necho broken >&2; exit 1\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    assert native.load(cpu_attention._SOURCE) is None
    assert not list((fresh / "native").glob("*.so"))


def test_disabled_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv("LLMKIT_NATIVE", "0")
    assert native.load(cpu_attention._SOURCE) is None
