"""Whether a decode block runs on the fused GEMVs (``triton_gemv.py``) or on cuBLAS, measured.

Which is faster depends on the GPU and the shapes: at a 0.5B model's widths a step is bound by its
~250 launches and fewer, fused kernels win; at 8B widths a step streams 16 GB of weights and the
question is whose loads reach more of the bandwidth. So where ``LLMKIT_TRITON_GEMV`` is unset, the
first block of each shape and row count to run outside a CUDA-graph capture (the capture's warm-up
forwards, or the first eager decode) times both forms, each as a CUDA graph of a few repetitions,
and every later call with that key takes the faster. A failed measurement keeps cuBLAS (today's
form), so the choice can cost a start-up nothing worse than the old default.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

import torch

log = logging.getLogger(__name__)

REPS = 8  # forms captured per graph: launch gaps count as they do in the step's graph
TRIALS = 3  # replays of each graph; the fastest counts

_decided: dict[Hashable, bool] = {}


def graph_time(fn: Callable[[], object]) -> float:
    """Seconds per call of ``fn`` replayed in a CUDA graph of :data:`REPS` calls (fastest of
    :data:`TRIALS` replays)."""
    # compile and allocate outside the capture, on a side stream as torch's graph recipe does
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    best = float("inf")
    for _ in range(TRIALS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / REPS)
    return best


#: the timer (tests swap in a wall clock: there is no CUDA graph on a CPU)
timer: Callable[[Callable[[], object]], float] = graph_time


def gemv_faster(key: Hashable, gemv: Callable[[], object], blas: Callable[[], object]) -> bool:
    """Whether ``gemv`` (the block on the fused GEMVs) beats ``blas`` (the block on cuBLAS) for
    ``key``; measured once per key. Both forms must be safe to repeat: a decode block rewrites the
    same K/V into the same slots. Never measured inside a capture: undecided keys take cuBLAS there."""
    choice = _decided.get(key)
    if choice is not None:
        return choice
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    try:
        t_gemv, t_blas = timer(gemv), timer(blas)
    except Exception as exc:  # a GPU or driver where the timing does not run: today's form
        log.warning("could not time the decode GEMVs (%s: %s); keeping cuBLAS for %s", type(exc).__name__, exc, key)
        choice = False
    else:
        choice = t_gemv < t_blas
        log.info(
            "decode block %s: fused GEMVs %.1f us, cuBLAS %.1f us: %s",
            key,
            t_gemv * 1e6,
            t_blas * 1e6,
            "GEMVs" if choice else "cuBLAS",
        )
    _decided[key] = choice
    return choice
