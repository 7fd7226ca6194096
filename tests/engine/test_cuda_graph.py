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


def _run(engine, prompts, params: list[SamplingParams]) -> list[dict]:
    """Each prompt's token ids, logprobs and finish reason, prompt i with ``params[i % len]``."""
    out, done = {}, threading.Semaphore(0)
    for i, ids in enumerate(prompts):

        def sink(o, i=i):
            r = out.setdefault(i, dict(ids=[], lps=[]))
            r["ids"] += o.token_ids
            r["lps"] += [(lp.token_id, round(lp.logprob, 3)) for lp in o.logprobs]
            if o.finished:
                r["reason"] = o.finish_reason
                done.release()

        engine.submit(GenerateRequest(f"g{i}", ids, params[i % len(params)]), sink)
    for _ in prompts:
        assert done.acquire(timeout=300)
    return [out[i] for i in range(len(prompts))]


def _greedy(engine, prompts, n=24):
    return [
        r["ids"] for r in _run(engine, prompts, [SamplingParams(max_new_tokens=n, min_new_tokens=n, temperature=0)])
    ]


def _deterministic_engine(model, **kw):
    """An fp32 Triton engine on CUDA whose rows do not depend on their batch (graphs up to 8 rows
    unless ``kw`` says otherwise)."""
    kw.setdefault("cuda_graph_max_bs", 8)
    return start_engine(
        model_path=str(model),
        device="cuda",
        attention="triton",
        enable_deterministic_inference=True,
        dtype="float32",
        **kw,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_replay_equals_eager(tmp_path):
    prompts = [[1, 200 + i, 300, 400 + 7 * i] for i in range(5)]  # 5 seqs: replays the bs=8 bucket
    results = []
    model = tiny_model_dir(tmp_path)  # no embedded-model package needed on the GPU machine
    for disable in (True, False):
        engine = _deterministic_engine(model, disable_cuda_graph=disable)
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


def _mixed(engine, prompts, n=24):
    """Greedy, seeded and logprob rows that end at different lengths and on stop ids."""
    params = [
        SamplingParams(max_new_tokens=n, temperature=0),
        SamplingParams(max_new_tokens=n - 5, temperature=0.8, top_p=0.9, seed=11),
        SamplingParams(max_new_tokens=n, temperature=0, logprobs=True, top_logprobs=2),
        SamplingParams(max_new_tokens=7, temperature=0),
        SamplingParams(max_new_tokens=n, temperature=0, stop_token_ids=[300, 301, 302]),
    ]
    return _run(engine, prompts, params)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_chained_steps_on_cuda_equal_steps_one_after_another(tmp_path):
    """On CUDA the overlap schedule launches each step from the device's picks before the host
    reads them (through the captured graphs): same tokens, logprobs and finishes as without it."""
    prompts = [[1, 200 + i, 300, 400 + 7 * i] for i in range(10)]
    model = tiny_model_dir(tmp_path)
    results = []
    for overlap in (False, True):
        engine = _deterministic_engine(model, overlap_schedule=overlap, cuda_graph_max_bs=16)
        try:
            results.append(_mixed(engine, prompts))
            assert (engine.chained_steps > 0) == overlap
        finally:
            engine.shutdown()
    assert results[0] == results[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_adapter_rows_replay_graphs_and_equal_eager(tmp_path):
    """Decode steps mixing two LoRA adapters and base rows replay the captured graphs (the rows'
    slots staged into the graph's buffer) and answer as eager steps do; later steps with fewer
    rows and another mix reuse the same graphs."""
    from lora_utils import save_adapter, save_tiny_llama

    save_tiny_llama(tmp_path / "base")
    save_adapter(tmp_path / "base", tmp_path / "a", seed=1, r=8)
    save_adapter(tmp_path / "base", tmp_path / "b", seed=2, r=4, targets=["q_proj", "v_proj", "down_proj"])
    loras = ["a", "b", None, "a", None, "b"]
    prompts = [[3, 17 + i, 99, 250 + 5 * i] for i in range(len(loras))]
    results, adapter_replays = [], []
    for disable in (True, False):
        engine = _deterministic_engine(
            tmp_path / "base", disable_cuda_graph=disable, lora_paths=(f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}")
        )
        try:
            seen = []
            if not disable:
                graphs, replay = engine.runner.graphs, engine.runner.graphs.replay
                assert graphs.lora is not None, "graphs were captured without the LoRA slots"

                def spy(*a, **kw):
                    seen.append(engine.runner.lora.batch.row_slot is not None)
                    return replay(*a, **kw)

                graphs.replay = spy
            out, done = {}, threading.Semaphore(0)
            for i, (ids, lora) in enumerate(zip(prompts, loras)):
                n = 6 + 3 * i  # rows finish at different steps: the batch shrinks and its mix changes

                def sink(o, i=i):
                    out.setdefault(i, []).extend(o.token_ids)
                    if o.finished:
                        done.release()

                params = SamplingParams(max_new_tokens=n, min_new_tokens=n, temperature=0)
                engine.submit(GenerateRequest(f"g{i}", ids, params, lora=lora), sink)
            for _ in prompts:
                assert done.acquire(timeout=300)
            results.append([out[i] for i in range(len(prompts))])
            adapter_replays.append(sum(seen))
        finally:
            engine.shutdown()
    assert results[0] == results[1]
    assert adapter_replays[1] > 5, "no decode step with adapter rows replayed a graph"
    assert len({tuple(r) for r in results[0]}) == len(prompts)
