"""CUDA-graph decode replay equals eager decode (GPU only; skipped without CUDA)."""

from __future__ import annotations

import threading

import pytest
import torch

from llmkit.core.engine.cuda_graph import batch_buckets
from llmkit.core.engine.messages import GenerateRequest, SamplingParams

from model_utils import start_engine, tiny_model_dir


def test_buckets_cover_every_batch_size():
    for max_bs in (1, 3, 8, 20, 32, 160):
        b = batch_buckets(max_bs)
        assert b[0] == 1 and b[-1] == max_bs and b == sorted(set(b))


def _greedy(engine, prompts, n=24):
    out, done = {}, threading.Semaphore(0)
    for i, ids in enumerate(prompts):

        def sink(o, i=i):
            out.setdefault(i, []).extend(o.token_ids)
            if o.finished:
                done.release()

        engine.submit(
            GenerateRequest(f"g{i}", ids, SamplingParams(max_new_tokens=n, min_new_tokens=n, temperature=0)), sink
        )
    for _ in prompts:
        assert done.acquire(timeout=300)
    return [out[i] for i in range(len(prompts))]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_replay_equals_eager(tmp_path):
    prompts = [[1, 200 + i, 300, 400 + 7 * i] for i in range(5)]  # 5 seqs: replays the bs=8 bucket
    results = []
    model = tiny_model_dir(tmp_path)  # no embedded-model package needed on the GPU machine
    for disable in (True, False):
        engine = start_engine(
            model_path=str(model),
            device="cuda",
            attention="triton",
            disable_cuda_graph=disable,
            enable_deterministic_inference=True,
            cuda_graph_max_bs=8,
            dtype="float32",
        )
        try:
            assert (engine.runner.graphs is None) == disable
            results.append(_greedy(engine, prompts))
        finally:
            engine.shutdown()
    assert results[0] == results[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flashinfer_decodes_eagerly(tmp_path):
    """The flashinfer plugin has no graph hooks: it must run eagerly rather than fail to capture."""
    pytest.importorskip("flashinfer")
    model = str(tiny_model_dir(tmp_path))
    engine = start_engine(model_path=model, device="cuda", attention="flashinfer", dtype="float32")
    try:
        assert engine.runner.graphs is None
        assert all(len(t) == 24 for t in _greedy(engine, [[1, 200, 300], [1, 201, 300, 401]]))
    finally:
        engine.shutdown()
