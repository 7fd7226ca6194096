"""The defaults that make a big GPU work: the KV pool and the running limit from the GPU's memory
(SGLang's sizing), and the start-up warm-up. The sizing is arithmetic over what
``torch.cuda.mem_get_info`` reports, checked here with the figures the H200 reported; the warm-up
runs on CPU too when asked for (it is on by default on CUDA only)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.messages import GenerateRequest, SamplingParams
from llmkit.core.engine.stages import sizing

from model_utils import start_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from gpu_presets import write_model_dir  # noqa: E402

GIB = 1 << 30
H200 = 143771 * (1 << 20)  # bytes, as nvidia-smi and mem_get_info report it
LLAMA8B_TOKEN = 32 * 8 * (128 + 128) * 2  # bytes a token of Llama-3.1-8B's bf16 KV takes
LLAMA8B_CONTEXT = 131072
ROW = (LLAMA8B_CONTEXT + 1) * 8


@pytest.fixture
def h200_after_weights(monkeypatch):
    """An H200 with Llama-8B's 16.1 GB of weights and a CUDA context loaded."""
    used = int(16.1e9) + GIB // 2
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (H200 - used, H200))
    return used


def test_pool_and_running_limit_come_from_the_gpu(h200_after_weights):
    tokens, running = sizing.cuda_sizes(EngineConfig(), LLAMA8B_TOKEN, LLAMA8B_CONTEXT, ROW, "cuda")
    # the old default was the CPU formula's 65,536 tokens and 64 running requests
    assert running == 2048  # 512 a full context of pool, capped
    budget = int(H200 * sizing.CUDA_MEM_FRACTION) - h200_after_weights - (running + 1) * ROW
    assert tokens == budget // LLAMA8B_TOKEN
    assert 800_000 < tokens < 1_000_000  # ~110 GB of KV: 14x the 8.6 GB the CPU formula gave
    assert (tokens * LLAMA8B_TOKEN + h200_after_weights) / H200 <= sizing.CUDA_MEM_FRACTION


def test_explicit_flags_win(h200_after_weights):
    cfg = EngineConfig(max_running_requests=128, max_total_tokens=100_000)
    assert sizing.cuda_sizes(cfg, LLAMA8B_TOKEN, LLAMA8B_CONTEXT, ROW, "cuda") == (100_000, 128)
    tokens, running = sizing.cuda_sizes(
        EngineConfig(mem_fraction_static=0.6), LLAMA8B_TOKEN, LLAMA8B_CONTEXT, ROW, "cuda"
    )
    budget = int(H200 * 0.6) - h200_after_weights
    assert running == min(max(budget // LLAMA8B_TOKEN * 512 // LLAMA8B_CONTEXT, 64), 2048)
    assert tokens == (budget - (running + 1) * ROW) // LLAMA8B_TOKEN


def test_small_models_stop_at_the_pool_ceiling(h200_after_weights):
    qwen05_token = 24 * 2 * (64 + 64) * 2
    tokens, running = sizing.cuda_sizes(EngineConfig(), qwen05_token, 32768, 32769 * 8, "cuda")
    assert tokens == sizing.CUDA_MAX_POOL_TOKENS and running == 2048


def test_too_little_memory_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GIB, 24 * GIB))
    with pytest.raises(ValueError, match="too little free memory"):
        sizing.cuda_sizes(EngineConfig(), LLAMA8B_TOKEN, LLAMA8B_CONTEXT, ROW, "cuda")


def test_cpu_keeps_its_running_default(tmp_path):
    write_model_dir("tiny", tmp_path)
    engine = start_engine(model_path=str(tmp_path), load_format="dummy")
    try:
        assert engine.scheduler.config.max_running_requests == sizing.CPU_MAX_RUNNING
        assert engine.runner.req_pool.table.shape[0] == sizing.CPU_MAX_RUNNING + 1
    finally:
        engine.shutdown()


def _greedy(engine, ids):
    out, done = [], threading.Event()

    def sink(o):
        out.extend(o.token_ids)
        if o.finished:
            done.set()

    engine.submit(
        GenerateRequest("after", ids, SamplingParams(max_new_tokens=6, min_new_tokens=6, temperature=0.0)), sink
    )
    assert done.wait(120)
    return out


def test_warm_up_runs_before_serving_and_leaves_no_trace(tmp_path, caplog):
    write_model_dir("tiny", tmp_path)
    outputs = []
    for warmup in (False, True):
        with caplog.at_level("INFO", logger="llmkit"):
            engine = start_engine(model_path=str(tmp_path), load_format="dummy", warmup=warmup)
        try:
            assert ("Warm-up:" in caplog.text) == warmup
            sched = engine.scheduler
            assert engine.steps == 0 and sched.prefix_cache_queries == 0 and not sched.running
            assert not sched.waiting and not engine.output.streams
            outputs.append(_greedy(engine, [7, 8, 9, 10]))
        finally:
            engine.shutdown()
        caplog.clear()
    assert outputs[0] == outputs[1] and len(outputs[0]) == 6


def test_warm_up_leaves_no_speculative_counts(tmp_path):
    from llmkit.core.engine.builder import build_engine_parts
    from llmkit.core.engine.config import EngineConfig
    from llmkit.core.engine.loop import Engine

    write_model_dir("tiny", tmp_path)
    cfg = EngineConfig(
        model_path=str(tmp_path),
        load_format="dummy",
        grammar_backend="none",
        warmup=True,
        speculative_algorithm="NGRAM",
    )
    engine = Engine(cfg, build_engine_parts(cfg))
    engine.speculator.proposer.propose = lambda req, n: [req.all_ids[-1]] * n  # drafts every step
    engine.start()  # warms up first, on this thread
    try:
        assert engine.stats()["spec_verify_steps"] == 0 and engine.stats()["spec_draft_tokens"] == 0
    finally:
        engine.shutdown()


def test_warm_up_runs_chained_steps_and_leaves_their_count_at_zero(tmp_path, monkeypatch):
    """The warm-up's last round has nothing for the host to do per row, so with the overlap
    schedule (on by default on CUDA; forced here) its decode steps take the chained path a plain
    first request takes."""
    from llmkit.core.engine.loop import Engine

    chained = []
    real = Engine._launch_chained

    def counting(self, nxt, inflight):
        launched = real(self, nxt, inflight)
        chained.append(launched is not None)
        return launched

    monkeypatch.setattr(Engine, "_launch_chained", counting)
    write_model_dir("tiny", tmp_path)
    engine = start_engine(model_path=str(tmp_path), load_format="dummy", warmup=True, overlap_schedule=True)
    try:
        assert any(chained) and engine.chained_steps == 0
    finally:
        engine.shutdown()
