"""``llmkit serve``'s options for the engine's batches, KV cache, CUDA graphs and warm-up."""

from __future__ import annotations

from typing import Optional

from llmkit.cli.option_table import ServeOption, only_when_given, panel


def _engine_process(given, p) -> dict:
    # Data- and tensor-parallel engines always run in processes of their own.
    return {"engine.engine_process": given or p["dp_size"] > 1 or p["tp_size"] > 1}


ENGINE_OPTIONS = panel(
    "Scheduling and memory",
    ServeOption(
        ("--context-length",),
        Optional[int],
        None,
        to="engine",
        envvar="LLMKIT_CONTEXT_LENGTH",
        help="Override the model's context length.",
    ),
    ServeOption(
        ("--max-running-requests",),
        Optional[int],
        None,
        to="engine",
        envvar="LLMKIT_MAX_RUNNING_REQUESTS",
        help="Most requests decoding at once (default: 64 on CPU; on CUDA from the KV pool, 64 to 2048).",
    ),
    ServeOption(
        ("--max-queued-requests",),
        int,
        1024,
        to="engine",
        help="Requests held at once; beyond this new ones get 429.",
    ),
    ServeOption(
        ("--max-total-tokens",),
        Optional[int],
        None,
        to="engine",
        envvar="LLMKIT_MAX_TOTAL_TOKENS",
        help="KV cache pool size in tokens (default on CPU: max(2 x context, 512 x --max-running-requests), "
        "at most 65,536 tokens or 20% of RAM; on CUDA: 0.88 of the GPU's memory less what is in use "
        "after the weights, see --mem-fraction-static).",
    ),
    ServeOption(
        ("--mem-fraction-static",),
        Optional[float],
        None,
        to="engine",
        help="Fraction of the device's memory (RAM on CPU) for weights plus the KV pool; "
        "the pool gets the rest after the weights (on CUDA after everything in use by then; "
        "default there 0.88, on CPU see --max-total-tokens). "
        "--max-total-tokens wins when both are given.",
    ),
    ServeOption(
        ("--kv-cache-dtype",),
        str,
        "auto",
        to="engine",
        envvar="LLMKIT_KV_CACHE_DTYPE",
        help="KV cache dtype: auto (the model's: fp32 on CPU), bfloat16/bf16 or float16/fp16 (half an fp32 "
        "pool: twice the tokens in the same memory), fp8_e4m3/fp8 or fp8_e5m2 (unscaled; torch backend, "
        "or triton on CUDA 8.9+).",
    ),
    ServeOption(("--page-size",), int, 1, to="engine", envvar="LLMKIT_PAGE_SIZE", help="Tokens per KV page."),
    ServeOption(
        ("--chunked-prefill-size",),
        int,
        2048,
        to="engine",
        envvar="LLMKIT_CHUNKED_PREFILL_SIZE",
        help="Token budget per step (prefill chunks plus decode tokens).",
    ),
    ServeOption(
        ("--schedule-policy",),
        str,
        "fcfs",
        to="engine",
        envvar="LLMKIT_SCHEDULE_POLICY",
        help="fcfs or lpm (longest prefix match first).",
    ),
    ServeOption(
        ("--disable-radix-cache",),
        bool,
        False,
        to="engine",
        envvar="LLMKIT_DISABLE_RADIX_CACHE",
        help="Turn off prefix sharing.",
    ),
    ServeOption(
        ("--enable-deterministic-inference",),
        bool,
        False,
        to="engine",
        envvar="LLMKIT_DETERMINISTIC",
        help="Batch-invariant numerics: a request's output never depends on its batch.",
    ),
    ServeOption(
        ("--num-threads",),
        Optional[int],
        None,
        to="engine",
        envvar="LLMKIT_NUM_THREADS",
        help="torch CPU threads (default: all cores).",
    ),
    ServeOption(
        ("--cuda-graph-max-bs",),
        Optional[int],
        None,
        to="engine",
        envvar="LLMKIT_CUDA_GRAPH_MAX_BS",
        help="Largest decode batch replayed from a captured CUDA graph (default: --max-running-requests, at most 256).",
    ),
    ServeOption(
        ("--disable-cuda-graph",),
        bool,
        False,
        to="engine",
        envvar="LLMKIT_DISABLE_CUDA_GRAPH",
        help="Run decode steps eagerly on CUDA.",
    ),
    ServeOption(
        ("--skip-server-warmup",),
        bool,
        False,
        to=only_when_given("engine.warmup", False),
        envvar="LLMKIT_SKIP_SERVER_WARMUP",
        help="Report ready without first serving a few short requests (on CUDA the warm-up compiles the "
        "kernels the first request would otherwise wait for; CPU has none).",
    ),
    ServeOption(
        ("--enable-server-warmup",),
        bool,
        False,
        to=only_when_given("engine.warmup", True),
        envvar="LLMKIT_ENABLE_SERVER_WARMUP",
        help="Warm up on CPU too (on by default on CUDA): the engine's short requests, then one request of "
        "each kind through the routes, before /health answers.",
    ),
    ServeOption(
        ("--disable-overlap-schedule",),
        bool,
        False,
        to=only_when_given("engine.overlap_schedule", False),
        envvar="LLMKIT_DISABLE_OVERLAP_SCHEDULE",
        help="Post-process each step before launching the next (overlap is on by default on CUDA).",
    ),
    ServeOption(
        ("--enable-overlap-schedule",),
        bool,
        False,
        to=only_when_given("engine.overlap_schedule", True),
        envvar="LLMKIT_ENABLE_OVERLAP_SCHEDULE",
        help="Overlap post-processing with the next step on CPU too (for testing; no speed-up there).",
    ),
    ServeOption(
        ("--engine-process",),
        bool,
        False,
        to=_engine_process,
        envvar="LLMKIT_ENGINE_PROCESS",
        help="Run the engine in its own process (ZeroMQ + msgpack over unix sockets), so the server's Python "
        "work never shares the engine's GIL; a dead engine process fails its requests and stops the server.",
    ),
)
