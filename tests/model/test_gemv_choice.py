"""The measured choice between the fused decode GEMVs and cuBLAS (``core/model/gemv_choice.py``):
timed once per key with the faster form kept, never timed inside a CUDA-graph capture, and cuBLAS
kept where the timing fails. The CPU has no CUDA graphs, so the timer here is a stand-in that
reports what the test says; on a GPU the timer is ``graph_time`` (the GPU check's ``kernels``
section logs its choices)."""

from __future__ import annotations

import pytest
import torch

from llmkit.core.model import gemv_choice


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(gemv_choice, "_decided", {})


def _timer(times: dict):
    calls = []

    def timer(fn):
        calls.append(fn)
        fn()  # (the forms run under the timer)
        return times[fn.__name__]

    return timer, calls


def gemv():
    return "g"


def blas():
    return "b"


@pytest.mark.parametrize(("t_gemv", "t_blas", "want"), [(1e-5, 2e-5, True), (3e-5, 2e-5, False)])
def test_the_faster_form_is_kept_and_timed_once(monkeypatch, t_gemv, t_blas, want):
    timer, calls = _timer({"gemv": t_gemv, "blas": t_blas})
    monkeypatch.setattr(gemv_choice, "timer", timer)
    assert gemv_choice.gemv_faster(("k", 1), gemv, blas) is want
    assert gemv_choice.gemv_faster(("k", 1), gemv, blas) is want
    assert len(calls) == 2  # each form once, for the first call only
    gemv_choice.gemv_faster(("k", 2), gemv, blas)  # another row count: its own measurement
    assert len(calls) == 4


def test_a_failed_timing_keeps_cublas(monkeypatch, caplog):
    def broken(fn):
        raise RuntimeError("no graphs here")

    monkeypatch.setattr(gemv_choice, "timer", broken)
    assert gemv_choice.gemv_faster("k", gemv, blas) is False
    assert "keeping cuBLAS" in caplog.text
    monkeypatch.setattr(gemv_choice, "timer", _timer({"gemv": 0.0, "blas": 1.0})[0])
    assert gemv_choice.gemv_faster("k", gemv, blas) is False  # decided: not timed again


def test_not_timed_inside_a_capture(monkeypatch):
    timer, calls = _timer({"gemv": 0.0, "blas": 1.0})
    monkeypatch.setattr(gemv_choice, "timer", timer)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert gemv_choice.gemv_faster("k", gemv, blas) is False and not calls
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert gemv_choice.gemv_faster("k", gemv, blas) is True and len(calls) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_timer_tells_a_small_product_from_a_large_one():
    """On a GPU, the real timer (CUDA graphs of a few calls) picks the cheaper of two forms."""
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    small, large = (torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16) for n in (64, 32768))

    def gemv():
        return x @ small.T

    def blas():
        return x @ large.T

    t_small, t_large = gemv_choice.graph_time(gemv), gemv_choice.graph_time(blas)
    assert 0 < t_small < t_large < 1.0, (t_small, t_large)
    assert gemv_choice.gemv_faster("gpu", gemv, blas) is True
