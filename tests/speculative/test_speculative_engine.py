"""Speculative decoding does not change the output: the real engine on the embedded model gives
the same tokens with ``--speculative-algorithm NGRAM`` as without, greedy and seeded sampling,
copy-heavy prompts (drafts accepted) and plain ones (drafts rejected), one by one and batched."""

from __future__ import annotations

import pytest
from spec_utils import assert_same_outputs, generate_all_then_stop

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


@pytest.fixture(scope="module")
def reference():
    return generate_all_then_stop(start_engine(), PROMPTS, SAMPLING)[0]


@pytest.mark.parametrize("draft_tokens", [2, 6])
def test_ngram_leaves_every_output_unchanged(reference, draft_tokens):
    engine = start_engine(speculative_algorithm="NGRAM", speculative_num_draft_tokens=draft_tokens)
    got, stats = generate_all_then_stop(engine, PROMPTS, SAMPLING)
    assert len(reference) == len(PROMPTS) * len(SAMPLING)
    assert_same_outputs(got, reference)
    assert stats.verify_steps > 0 and stats.accepted_tokens > 0  # the copy prompt took drafts
    assert stats.accept_length > 1.0
