"""With sampling, speculative decoding draws from the target model's distribution: a chi-square
test of the tokens a drafted step emits against the probabilities transformers gives.

A tiny random Llama samples three tokens from a prompt that holds every bigram of four tokens
(``logit_bias`` keeps the draws on those four), so after the first token the n-gram proposer always
finds a draft: the second token is scored with a draft beside it and the third, when the draft is
kept, comes out of the same verify step. A verifier that kept drafts too eagerly (or dropped them)
would skew the joint law of those two tokens; the test has the power to see a skew of a few percent.
"""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from llmkit.core.engine.messages import GenerateRequest, SamplingParams

from model_utils import start_engine

pytestmark = pytest.mark.slow  # ~20 s: 2,000 short requests on a tiny model

CELLS = [100, 200, 300, 400]  # token ids of the tiny model's vocabulary (512)
SAMPLES = 2000
TEMPERATURE = 1.0  # the seeded tiny model's law over these cells is skewed (cells from 0.5% to 31%)


def _de_bruijn() -> list[int]:
    """A cycle over CELLS holding each ordered pair once (B(4, 2)), closed: 17 tokens."""
    k, a, seq = len(CELLS), [0] * 4, []

    def db(t, p):
        if t > 2:
            if 2 % p == 0:
                seq.extend(a[1 : p + 1])
        else:
            a[t] = a[t - p]
            db(t + 1, p)
            for j in range(a[t - p] + 1, k):
                a[t] = j
                db(t + 1, t)

    db(1, 1)
    return [CELLS[i] for i in seq + seq[:1]]


def _target_law(model_dir, prompt: list[int]) -> torch.Tensor:
    """P(t2, t3) over CELLS x CELLS, summed over t1, from transformers' logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    @torch.no_grad()
    def next_law(ids):
        logits = model(torch.tensor([prompt + ids])).logits[0, -1, CELLS]
        return torch.softmax(logits.double() / TEMPERATURE, dim=0)

    law = torch.zeros(4, 4, dtype=torch.float64)
    p1 = next_law([])
    for i, a in enumerate(CELLS):
        p2 = next_law([a])
        for j, b in enumerate(CELLS):
            law[j] += p1[i] * p2[j] * next_law([a, b])
    return law


def test_drafted_steps_sample_the_target_distribution(tiny_llama):
    from scipy.stats import chisquare

    prompt = _de_bruijn()
    assert len(set(itertools.pairwise(prompt))) == 16
    law = _target_law(tiny_llama, prompt)
    assert law.sum().item() == pytest.approx(1.0)
    assert law.max() / law.min() > 3, "the test needs a skewed law to see anything"

    engine = start_engine(model_path=str(tiny_llama), speculative_algorithm="NGRAM", speculative_num_draft_tokens=2)
    done, outs = threading.Event(), {}
    try:
        bias = {t: 100.0 for t in CELLS}  # the other tokens are never drawn

        def sink_for(i):
            def sink(o):
                outs.setdefault(i, []).extend(o.token_ids)
                if o.finished and len(outs) == SAMPLES and all(len(v) == 3 for v in outs.values()):
                    done.set()

            return sink

        for i in range(SAMPLES):
            params = SamplingParams(max_new_tokens=3, temperature=TEMPERATURE, logit_bias=bias, seed=i, ignore_eos=True)
            engine.submit(GenerateRequest(f"r{i}", prompt, params), sink_for(i))
        assert done.wait(300), f"{len(outs)} of {SAMPLES} requests finished"
        stats = engine.speculator.stats
    finally:
        engine.shutdown()

    assert stats.verify_steps == SAMPLES  # every request's second token was drafted
    assert 0 < stats.accepted_tokens < SAMPLES  # drafts kept and rejected, so both paths are tested
    observed = torch.zeros(4, 4)
    for tokens in outs.values():
        observed[CELLS.index(tokens[1]), CELLS.index(tokens[2])] += 1
    expected = law * SAMPLES
    result = chisquare(observed.flatten().numpy(), expected.flatten().numpy())
    assert result.pvalue > 1e-3, (observed, expected, result)
