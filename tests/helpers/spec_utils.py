"""Shared by the speculative decoding tests: serving a set of prompts on an in-process engine, and
walking a draft-head proposer through proposals whose drafts the target partly rejects."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch

from llmkit.core.engine.messages import GenerateRequest, SamplingParams

from model_utils import start_engine

PROMPTS = [[5, 6, 7, 8, 9] * 3, [11, 12, 13], [100, 200, 300, 400, 100, 200, 300]]
SAMPLING = [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.9, "seed": 3}]


def serve_prompts(model_path, max_new_tokens: int = 24, **spec) -> tuple[dict, object]:
    """Every prompt under every sampling setting at once on an engine (``spec``: its speculative
    options): the tokens per ``(prompt, setting)``, and the speculator's stats (None: none)."""
    engine = start_engine(model_path=str(model_path), **spec)
    done, outs, finished = threading.Event(), {}, set()
    total = len(PROMPTS) * len(SAMPLING)

    def sink_for(key):
        def sink(o):
            outs.setdefault(key, []).extend(o.token_ids)
            if o.finished:
                finished.add(key)
                if len(finished) == total:
                    done.set()

        return sink

    try:
        for i, ids in enumerate(PROMPTS):
            for j, kw in enumerate(SAMPLING):
                params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **kw)
                engine.submit(GenerateRequest(f"p{i}-s{j}", ids, params), sink_for((i, j)))
        assert done.wait(300)
        return outs, engine.speculator.stats if engine.speculator else None
    finally:
        engine.shutdown()


def walk_proposals(proposer, expected, width: int, vocab: int, prompt_len: int = 7, first: int = 0) -> None:
    """A request of ``prompt_len`` random tokens whose positions from ``first`` on the target
    computed (a prefix-cache hit has no states before), then four proposals of 3 drafts, the target
    keeping 1, 0, 3 and 2 of them: each proposal must equal ``expected(states, ids, first, n, 3)``,
    ``states`` the target's hidden state rows (``width`` wide) by position, ``n`` the tokens
    computed."""
    g = torch.Generator().manual_seed(5)
    states: dict[int, torch.Tensor] = {}

    def computed(req, start, count):  # the target computed these positions: their states
        rows = torch.randn(count, width, generator=g)
        for j in range(count):
            states[start + j] = rows[j]
        proposer.observe(req, start, rows)

    ids = [int(i) for i in torch.randint(0, vocab, (prompt_len,), generator=g)]
    req = SimpleNamespace(all_ids=ids, num_computed=first, spec_state=None, mm=None)
    computed(req, first, prompt_len - first)  # the prefill; the target samples the next token
    ids.append(11)
    req.num_computed = prompt_len
    for round_, keep in enumerate([1, 0, 3, 2]):
        drafts = proposer.propose(req, 3)
        assert drafts == expected(states, ids, first, req.num_computed, 3), round_
        # the target verifies the last token and the 3 drafts (positions n..n+3 computed), keeps
        # ``keep`` drafts, then appends its own token (not the next draft)
        n = req.num_computed
        computed(req, n, 4)
        ids.extend(drafts[:keep])
        ids.append((drafts[keep] + 1) % vocab if keep < 3 else 42)
        req.num_computed = n + keep + 1


def serve_prompts_over_http(url: str, max_new_tokens: int = 24) -> tuple[dict, float]:
    """What :func:`serve_prompts` asks, asked of a running server through SGLang's ``/generate``
    (token ids in and out, one request at a time): the tokens per ``(prompt, setting)``, and the
    draft tokens the server has accepted so far (its ``/metrics``)."""
    import httpx

    outs = {}
    for i, ids in enumerate(PROMPTS):
        for j, kw in enumerate(SAMPLING):
            sampling = {"max_new_tokens": max_new_tokens, "ignore_eos": True, **kw}
            sampling["sampling_seed"] = sampling.pop("seed", None)
            body = {"input_ids": ids, "sampling_params": {k: v for k, v in sampling.items() if v is not None}}
            r = httpx.post(url + "/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            outs[(i, j)] = r.json()["output_ids"]
    time.sleep(1.1)  # an engine out of the server's process publishes its counters twice a second
    metrics = httpx.get(url + "/metrics", timeout=10).text
    accepted = [line for line in metrics.splitlines() if line.startswith("llmkit:spec_decode_num_accepted_tokens")]
    return outs, float(accepted[0].split()[-1]) if accepted else 0.0


# a --tp-size 2 server whose output a deterministic one-rank engine's equals
TP2_ARGS = ["--batch-storage", "none", "--enable-deterministic-inference", "--num-threads", "1", "--tp-size", "2"]


def tp2_and_one_rank(model_path, max_new_tokens: int = 24, **spec) -> tuple[tuple[dict, float], tuple[dict, object]]:
    """The prompts on a ``--tp-size 2`` server with ``spec`` (its tokens and accepted drafts, see
    :func:`serve_prompts_over_http`) and on a deterministic one-rank engine (:func:`serve_prompts`)."""
    from server_utils import start_server, stop_server

    one_rank = serve_prompts(model_path, max_new_tokens, enable_deterministic_inference=True, **spec)
    flags = [a for k, v in spec.items() for a in ("--" + k.replace("_", "-"), str(v))]
    proc, url = start_server(["--model-path", str(model_path), *TP2_ARGS, *flags])
    try:
        return serve_prompts_over_http(url, max_new_tokens), one_rank
    finally:
        stop_server(proc)


def generate_all(engine, texts: list[str], sampling: list[dict], n: int = 40) -> dict:
    """Every text (tokenized by the engine's tokenizer) under every sampling setting, submitted at
    once (one batch): the tokens and their logprobs per ``(text, setting)``."""
    done, outs, finished = threading.Event(), {}, set()
    total = len(texts) * len(sampling)

    def sink_for(key):
        def sink(o):
            tokens, lps = outs.setdefault(key, ([], []))
            tokens.extend(o.token_ids)
            lps.extend(lp.logprob for lp in o.logprobs)
            if o.finished:
                finished.add(key)
                if len(finished) == total:
                    done.set()

        return sink

    for i, text in enumerate(texts):
        ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        for j, kw in enumerate(sampling):
            params = SamplingParams(max_new_tokens=n, logprobs=True, **kw)
            engine.submit(GenerateRequest(f"p{i}-s{j}", ids, params), sink_for((i, j)))
    assert done.wait(600)
    return outs


def generate_all_then_stop(engine, texts: list[str], sampling: list[dict]) -> tuple[dict, object]:
    """:func:`generate_all` on ``engine``, then the engine shut down: the outputs and the
    speculator's stats (None: none)."""
    try:
        return generate_all(engine, texts, sampling), engine.speculator.stats if engine.speculator else None
    finally:
        engine.shutdown()


def assert_same_outputs(got: dict, reference: dict) -> None:
    """:func:`generate_all`'s outputs: the same tokens (greedy and seeded alike), and a logprob per
    token within 2e-3 (a batch's rows are not bit for bit one request's)."""
    import pytest

    assert got.keys() == reference.keys()
    for key in reference:
        assert got[key][0] == reference[key][0], key
        assert got[key][1] == pytest.approx(reference[key][1], abs=2e-3), key
