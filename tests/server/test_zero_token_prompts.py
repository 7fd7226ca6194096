"""A prompt that tokenizes to nothing is refused alone: a 400 at the server, and at the engine a
failed request that never joins a batch, so the requests batched beside it still answer. The GPU
benchmark's model directories (benchmarks/gpu_presets.py) tokenize text under every preset.

Before these fixes a non-empty text that tokenized to zero tokens reached the engine and failed the
whole step (``shape '[0, 16]' is invalid``), a 500 for it and every co-batched request; and every
text tokenized to nothing under the ``qwen2`` presets' config (transformers 5 builds a
Qwen2Tokenizer there), so ``llmkit bench serve`` failed 100 of 100 requests against them."""

from __future__ import annotations

import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from llmkit.core.engine.messages import GenerateRequest, SamplingParams

from model_utils import start_engine
from server_utils import start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from gpu_presets import PRESETS, write_model_dir  # noqa: E402

DROPPED = "~"  # the test tokenizer's normalizer deletes it: "~~~" is a text of zero tokens


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The ``tiny`` preset as the benchmarks write it (a qwen2 config)."""
    d = tmp_path_factory.mktemp("tiny-preset")
    write_model_dir("tiny", d)
    return d


@pytest.fixture(scope="module")
def dropping_dir(tmp_path_factory):
    """The tiny preset's tokenizer under a llama config (transformers reads its tokenizer.json as
    written), with a normalizer that deletes ``DROPPED``."""
    d = tmp_path_factory.mktemp("dropping")
    write_model_dir("tiny", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (d / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((d / "tokenizer.json").read_text())
    tok["normalizer"] = {"type": "Replace", "pattern": {"String": DROPPED}, "content": ""}
    (d / "tokenizer.json").write_text(json.dumps(tok))
    return d


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_tokenizes_text(preset, tmp_path):
    """Text gives tokens and every id decodes, under the tokenizer class each config selects."""
    from transformers import AutoTokenizer

    write_model_dir(preset, tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    n = PRESETS[preset]["vocab_size"]
    assert len(tok) == n
    ids = tok("Hello, wörld!", add_special_tokens=False)["input_ids"]
    assert ids and all(0 <= i < n for i in ids)
    assert tok.decode(ids) == "Hello, wörld!"
    assert tok.decode([n - 1]) == f"t{n - 1}"


def test_tiny_preset_serves_text(tiny_dir):
    """``llmkit serve`` on the tiny preset (dummy weights): a text prompt has tokens and answers."""
    proc, url = start_server(["--model-path", str(tiny_dir), "--load-format", "dummy", "--batch-storage", "none"])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = client.completions.create(model="m", prompt="Hello there", max_tokens=4, temperature=0)
        assert r.usage.prompt_tokens == len("Hello there") and r.usage.completion_tokens == 4
    finally:
        stop_server(proc)


def test_zero_token_prompt_is_a_400_and_spares_its_batch(dropping_dir):
    proc, url = start_server(["--model-path", str(dropping_dir), "--load-format", "dummy", "--batch-storage", "none"])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="m", prompt=DROPPED * 3, max_tokens=4)
        assert "zero tokens" in str(e.value)

        def one(i: int):
            prompt = DROPPED * 3 if i % 3 == 0 else f"hello {i}"
            try:
                r = client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0)
                return 200, r.usage.completion_tokens
            except openai.APIStatusError as exc:
                return exc.status_code, None

        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(one, range(24)))
        for i, (status, n) in enumerate(results):
            assert (status, n) == ((400, None) if i % 3 == 0 else (200, 8)), (i, status)
    finally:
        stop_server(proc)


def test_engine_refuses_an_empty_request_alone(tiny_dir):
    """Submitted straight to the engine (no server check), an empty prompt fails by itself and the
    requests submitted with it finish normally."""
    engine = start_engine(model_path=str(tiny_dir), load_format="dummy", max_total_tokens=1024)
    try:
        outs: dict[str, list] = {}
        done = threading.Semaphore(0)

        def sink_for(rid):
            def sink(o):
                outs.setdefault(rid, []).append(o)
                if o.finished:
                    done.release()

            return sink

        prompts = {"a": [5, 6, 7], "empty": [], "b": [8, 9], "bad": [5, 10**6], "c": [2] * 20}
        for rid, ids in prompts.items():
            params = SamplingParams(max_new_tokens=6, min_new_tokens=6, temperature=0)
            engine.submit(GenerateRequest(rid, ids, params), sink_for(rid))
        for _ in prompts:
            assert done.acquire(timeout=120)
        for rid in ("a", "b", "c"):
            assert outs[rid][-1].error is None and sum(len(o.token_ids) for o in outs[rid]) == 6, rid
        assert "no tokens" in outs["empty"][-1].error
        assert "token ids must be in" in outs["bad"][-1].error
        assert engine.is_alive()
    finally:
        engine.shutdown()
