"""Speculative decoding does not change the output: the real engine on the embedded model gives
the same tokens with ``--speculative-algorithm NGRAM`` as without, greedy and seeded sampling,
copy-heavy prompts (drafts accepted) and plain ones (drafts rejected), one by one and batched."""

from __future__ import annotations

import threading

import pytest

from llmkit.core.engine.messages import GenerateRequest, SamplingParams

from model_utils import start_engine

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
PROMPTS = [
    f"<|im_start|>user\nRepeat this code exactly:\n{CODE * 2}<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nFix the typo and repeat: 'The quick brwn fox jumps over the lazy dog.'<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
]
SAMPLING = [
    {"temperature": 0},
    {"temperature": 0.8, "top_p": 0.95, "seed": 7},
    {"temperature": 1.0, "top_k": 20, "seed": 11, "frequency_penalty": 0.5},
]


def _run_all(engine, tokenizer, n: int = 40) -> dict:
    """Every prompt with every sampling setting, submitted at once (one batch)."""
    done, outs = threading.Event(), {}
    total = len(PROMPTS) * len(SAMPLING)

    def sink_for(key):
        def sink(o):
            tokens, lps = outs.setdefault(key, ([], []))
            tokens.extend(o.token_ids)
            lps.extend(round(lp.logprob, 3) for lp in o.logprobs)
            if o.finished:
                finished.add(key)
                if len(finished) == total:
                    done.set()

        return sink

    finished: set = set()
    for i, text in enumerate(PROMPTS):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for j, kw in enumerate(SAMPLING):
            params = SamplingParams(max_new_tokens=n, logprobs=True, **kw)
            engine.submit(GenerateRequest(f"p{i}-s{j}", ids, params), sink_for((i, j)))
    assert done.wait(600)
    return outs


@pytest.fixture(scope="module")
def reference():
    engine = start_engine()
    try:
        yield _run_all(engine, engine.tokenizer)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("draft_tokens", [2, 6])
def test_ngram_leaves_every_output_unchanged(reference, draft_tokens):
    engine = start_engine(speculative_algorithm="NGRAM", speculative_num_draft_tokens=draft_tokens)
    try:
        got = _run_all(engine, engine.tokenizer)
        stats = engine.speculator.stats
    finally:
        engine.shutdown()
    assert len(reference) == len(PROMPTS) * len(SAMPLING)
    for key in reference:
        assert got[key][0] == reference[key][0], key  # tokens, greedy and seeded alike
        assert got[key][1] == pytest.approx(reference[key][1], abs=2e-3), key  # a logprob per token
    assert stats.verify_steps > 0 and stats.accepted_tokens > 0  # the copy prompt took drafts
    assert stats.accept_length > 1.0
