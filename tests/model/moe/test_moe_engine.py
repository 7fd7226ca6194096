"""The new families under engine pressure: concurrent requests in a KV pool too small for all of
them (preemption: K/V, or MLA's latents, handed to the prefix cache and recomputed), small pages and
prefill chunks; every request's greedy tokens still equal transformers' ``generate``."""

from __future__ import annotations

import threading

import pytest

from llmkit.core.engine.messages import GenerateRequest, SamplingParams

from model_utils import assert_same_as_generate, copy_embedded_tokenizer, save_tiny_model, start_engine

pytestmark = pytest.mark.slow  # ~30 s: three engines under pressure

N = 24
PROMPTS = [[(31 * i + 7 * j) % 500 + 3 for j in range(20 + 3 * i)] for i in range(6)]


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_preempted_concurrent_requests_match_transformers(tmp_path, arch):
    ref = save_tiny_model(arch, tmp_path)
    copy_embedded_tokenizer(tmp_path)
    engine = start_engine(
        model_path=str(tmp_path),
        device="cpu",
        max_total_tokens=128,
        max_running_requests=6,
        page_size=4,
        chunked_prefill_size=16,
    )
    outs: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    left = threading.Semaphore(0)
    try:
        for i, ids in enumerate(PROMPTS):

            def sink(o, i=i):
                outs[i].extend(o.token_ids)
                if o.finished:
                    left.release()

            params = SamplingParams(max_new_tokens=N, min_new_tokens=N, temperature=0)
            engine.submit(GenerateRequest(f"p{i}", ids, params), sink)
        for _ in PROMPTS:
            assert left.acquire(timeout=300)
        assert engine.scheduler.num_preemptions > 0
    finally:
        engine.shutdown()
    for i, ids in enumerate(PROMPTS):
        assert len(outs[i]) == N
        assert_same_as_generate(ref, ids, outs[i], f"prompt {i}")
