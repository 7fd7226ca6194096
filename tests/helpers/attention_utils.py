"""Helpers of the kernel tests: subprocesses under Triton's interpreter, offline CUDA compiles.

The paged-KV batches the backend tests build (``build_batch``, ``make_metadata``, ``backend_kwargs``)
are the plugin authors' kit's, :mod:`llmkit.testing.attention`, re-exported here by their old names.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmkit.testing.attention import Batch, backend_kwargs, build_batch, make_metadata  # noqa: F401 (re-exported)

HELPERS = Path(__file__).resolve().parent  # tests/helpers
TESTS = HELPERS.parent


def _test_module(module: str) -> str:
    """The dotted name of test module ``module`` (a file name such as ``test_fused_ops``, found in any
    folder under tests/), as pytest imports it: ``tests.model.test_fused_ops``."""
    if "." in module:
        return module
    found = sorted(TESTS.rglob(f"{module}.py"))
    if len(found) != 1:
        raise LookupError(f"{module}.py: {len(found)} files under {TESTS}, expected one: {found}")
    return ".".join(found[0].relative_to(TESTS.parent).with_suffix("").parts)


def run_in_subprocesses(module: str, entry: str, jobs: list[list[str]], env: dict[str, str]) -> dict:
    """Run ``entry(job)`` of test module ``module`` (see :func:`_test_module`) in one fresh
    interpreter per job, in parallel (the Triton interpreter must be chosen before triton is
    imported); each prints one ``RESULTS`` JSON line, merged here."""
    paths = [str(HELPERS), str(TESTS.parent)]  # these helpers, and the repository root for ``tests.*``
    code = f"import sys; sys.path[:0] = {paths!r}; import {_test_module(module)} as t; t.{entry}(sys.argv[1:])"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, *job], env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for job in jobs
    ]
    results: dict[str, str] = {}
    for p in procs:
        out, err = p.communicate(timeout=600)
        line = next((s for s in out.splitlines() if s.startswith("RESULTS ")), None)
        if line is None:
            pytest.fail(f"subprocess failed (rc={p.returncode}):\n{err[-3000:]}")
        results.update(json.loads(line[len("RESULTS ") :]))
    return results


def report_runs(runs: list[str], check) -> None:
    """Subprocess side of :func:`run_in_subprocesses`: ``check(run)`` for each run, one ``RESULTS``
    JSON line of ``"ok"`` or the failure (with the end of its traceback) per run."""
    import traceback

    results = {}
    for run in runs:
        try:
            check(run)
            results[run] = "ok"
        except Exception as exc:  # reported to the parent test, which fails with this text
            results[run] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"
    print("RESULTS " + json.dumps(results))


def interpreted(module: str, runs: list[str]) -> dict[str, str]:
    """Test module ``module``'s ``_main`` over ``runs`` under Triton's interpreter, in two parallel
    subprocesses; skips without triton."""
    import os

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return run_in_subprocesses(module, "_main", [runs[0::2], runs[1::2]], env)


def assert_close_to_largest(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str, tol: dict) -> None:
    """``got`` (in ``dtype``) within ``tol[dtype]`` of an fp64 reference ``want``, relative to the
    reference's largest value (a kernel's output rounded once)."""
    assert got.dtype == dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
    if not want.numel():
        return
    scale = want.abs().max().item() or 1.0
    err = (got.double() - want).abs().max().item() / scale
    assert err <= tol[dtype], f"{what} {dtype}: error {err:.3g} of the largest value > {tol[dtype]}"


def kernel_run_tests(namespace: dict, module: str, runs: list[str], compile_runs: list[str], on_cuda=None) -> None:
    """Add a Triton test module's subprocess-backed test sets to ``namespace`` (its ``globals()``):
    ``test_interpreter_matches_torch``, one test per run of its ``_main`` under the interpreter
    (:func:`interpreted`), and ``test_kernels_compile_for_cuda``, one per run of its ``_compile_main``
    (:func:`compiled`); each set runs once for the module, in module-scoped fixtures. ``on_cuda``:
    ``on_cuda(run)`` checks a run compiled on a CUDA device (``test_compiled_matches_torch``, marked
    ``gpu``)."""

    @pytest.fixture(scope="module")
    def interpreter_results() -> dict[str, str]:
        return interpreted(module, runs)

    @pytest.mark.parametrize("run", runs)
    def test_interpreter_matches_torch(run: str, interpreter_results: dict[str, str]) -> None:
        assert interpreter_results[run] == "ok", interpreter_results[run]

    @pytest.fixture(scope="module")
    def compile_results() -> dict[str, str]:
        return compiled(module, compile_runs)

    @pytest.mark.parametrize("run", compile_runs)
    def test_kernels_compile_for_cuda(run: str, compile_results: dict[str, str]) -> None:
        assert compile_results[run] == "ok", compile_results[run]

    fns = [interpreter_results, test_interpreter_matches_torch, compile_results, test_kernels_compile_for_cuda]
    if on_cuda is not None:

        @pytest.mark.gpu
        @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
        @pytest.mark.parametrize("run", runs)
        def test_compiled_matches_torch(run: str) -> None:
            on_cuda(run)

        fns.append(test_compiled_matches_torch)
    for fn in fns:
        fn.__module__ = namespace["__name__"]
        namespace[fn.__name__] = fn


def compile_for_cuda(fn, arch: str, ptrs: dict, consts: dict, divisible: tuple = (), **options):
    """Compile Triton kernel ``fn`` for CUDA ``arch`` (e.g. "90") without a GPU: pointer arguments
    typed by ``ptrs``, ``consts`` as constexprs, the rest int32. ``divisible``: arguments marked
    divisible by 16, as a launch specializes aligned pointers and such sizes and strides (what lets
    the compiler vectorize loads)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {a: "constexpr" if a in consts else ptrs.get(a, "i32") for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    constexprs = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", int(arch), 32), options=options)


def compiled(module: str, runs: list[str]) -> dict[str, str]:
    """Test module ``module``'s ``_compile_main`` over ``runs`` in two subprocesses without the
    interpreter; skips where Triton cannot compile for CUDA here."""
    import os

    from tests.attention.test_triton_attention import _can_compile_for_cuda

    pytest.importorskip("triton")
    reason = _can_compile_for_cuda()
    if reason:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LLMKIT_TRITON_INTERPRET")}
    return run_in_subprocesses(module, "_compile_main", [runs[0::2], runs[1::2]], env)
