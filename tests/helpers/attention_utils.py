"""Builds paged-KV batches and their AttentionMetadata the way the engine does, for backend tests.

``build_batch`` takes each sequence's cached prefix length and new-token count, allocates pages
from a real :class:`KVCachePool` (in a shuffled order, so a sequence's pages are not contiguous),
lets sequences share prefix pages as the radix cache does, fills the prefixes' K/V with random
values in every layer, and returns the new tokens' q/k/v with the metadata.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from llmkit.core.kvcache.kv_pool import KVCachePool, ReqToTokenPool
from llmkit.core.model.attention import AttentionMetadata

HELPERS = Path(__file__).resolve().parent  # tests/helpers
TESTS = HELPERS.parent


@dataclass
class Batch:
    pool: KVCachePool
    req_pool: ReqToTokenPool
    md: AttentionMetadata
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor | None  # None: latent KV (the values are the keys' first channels)


def make_metadata(
    *,
    q_lens: list[int],
    kv_lens: list[int],
    rows: list[int],
    req_to_token: torch.Tensor,
    out_slots: torch.Tensor,
    page_size: int,
    deterministic: bool = False,
    decoding: list[bool] | None = None,
) -> AttentionMetadata:
    """AttentionMetadata with every field filled as the engine fills it (``decoding``: which
    sequences are decode rows; by default none is flagged)."""
    dev = req_to_token.device
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    i64 = dict(dtype=torch.int64, device=dev)
    return AttentionMetadata(
        num_seqs=len(q_lens),
        q_lens=list(q_lens),
        kv_lens=list(kv_lens),
        q_start_loc=torch.tensor(starts, **i64),
        q_lens_t=torch.tensor(q_lens, **i64),
        kv_lens_t=torch.tensor(kv_lens, **i64),
        req_pool_indices=torch.tensor(rows, **i64),
        req_to_token=req_to_token,
        out_slots=out_slots.to(dev),
        page_size=page_size,
        is_decode=all(n == 1 for n in q_lens),
        deterministic=deterministic,
        decoding=list(decoding or []),
    )


def build_batch(
    seqs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    num_layers: int = 1,
    share: dict[int, tuple[int, int]] | None = None,
    deterministic: bool = False,
    seed: int = 0,
    latent: bool = False,
    v_head_dim: int | None = None,
) -> Batch:
    """A batch of ``seqs`` = [(prefix_len, new_len), ...].

    ``share[i] = (j, n)``: sequence i's first ``n`` tokens (a multiple of ``page_size``, at most
    both prefixes) live in sequence j's pages (j < i), as after a radix-cache prefix match.
    ``latent``: a pool without V buffers and ``v`` None, as MLA's latent KV; ``v_head_dim``: V heads
    of another size than K's.
    """
    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    share = share or {}
    max_ctx = max(p + n for p, n in seqs) + page_size
    need = sum(-(-(p + n) // page_size) for p, n in seqs) + 4
    pool = KVCachePool(
        num_layers=num_layers,
        num_pages=need + 1,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        v_head_dim=0 if latent else v_head_dim,
    )
    # Scramble the free list so neighbouring tokens do not sit in neighbouring pages.
    pages = pool.allocate(pool.capacity_pages)
    pool.free([pages[i] for i in torch.randperm(len(pages), generator=g).tolist()])
    req_pool = ReqToTokenPool(len(seqs) + 2, max_ctx, device)
    req_pool.allocate()  # row 0 stays unused, so rows != sequence indices

    rows, seq_pages, out_slots = [], [], []
    for i, (prefix, new) in enumerate(seqs):
        row = req_pool.allocate()
        owned: list[int] = []
        if i in share:
            j, n = share[i]
            assert n % page_size == 0 and n <= prefix and n <= seqs[j][0] and j < i
            owned = seq_pages[j][: n // page_size]
        total_pages = -(-(prefix + new) // page_size)
        owned = owned + pool.allocate(total_pages - len(owned))
        slots = pool.page_slots(owned)[: prefix + new].to(device)
        req_pool.table[row, : prefix + new] = slots
        rows.append(row)
        seq_pages.append(owned)
        out_slots.append(slots[prefix:])
    for i, (prefix, _) in enumerate(seqs):  # shared slots are written twice: same last value wins
        slots = req_pool.table[rows[i], :prefix]
        for layer in range(num_layers):
            for buf in (pool.k_buffers[layer], *pool.v_buffers[layer : layer + 1]):
                buf[slots] = torch.randn((prefix, num_kv_heads, buf.shape[-1]), generator=g).to(buf)

    t = sum(n for _, n in seqs)
    q = torch.randn((t, num_heads, head_dim), generator=g).to(device=device, dtype=dtype)
    k = torch.randn((t, num_kv_heads, head_dim), generator=g).to(device=device, dtype=dtype)
    dv = v_head_dim or head_dim
    v = None if latent else torch.randn((t, num_kv_heads, dv), generator=g).to(device=device, dtype=dtype)
    md = make_metadata(
        q_lens=[n for _, n in seqs],
        kv_lens=[p + n for p, n in seqs],
        rows=rows,
        req_to_token=req_pool.table,
        out_slots=torch.cat(out_slots),
        page_size=page_size,
        deterministic=deterministic,
    )
    return Batch(pool, req_pool, md, q, k, v)


def backend_kwargs(batch: Batch, num_heads: int, v_head_dim: int | None = None) -> dict:
    """Constructor arguments of an AttentionBackend for ``batch`` (``v_head_dim``: the output's head
    size when it differs from the keys', as with a latent KV)."""
    k = batch.pool.k_buffers[0]
    kwargs = dict(num_heads=num_heads, num_kv_heads=k.shape[1], head_dim=k.shape[2], pool=batch.pool, device=k.device)
    if v_head_dim:
        kwargs["v_head_dim"] = v_head_dim
    return kwargs


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
