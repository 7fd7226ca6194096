"""The engine-level checks every hybrid family's tests share: prompts, a tiny engine with the
state cache in play (pages of 4 tokens, prompt chunks of 16, a snapshot every 16 prompt tokens),
requests submitted together, idle state counters, and a step that fails midway."""

from __future__ import annotations

import threading

from llmkit.core.engine.messages import GenerateRequest, SamplingParams

from model_utils import assert_same_as_generate, copy_embedded_tokenizer, save_tiny_model, start_engine


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + 11 * i) % 509 + 1 for i in range(n)]


def served_engine(arch: str, path, **overrides):
    """transformers' tiny ``arch`` model saved at ``path`` and an engine on it."""
    ref = save_tiny_model(arch, path)
    copy_embedded_tokenizer(path)
    kw = dict(page_size=4, chunked_prefill_size=16, max_total_tokens=2048, state_snapshot_interval=16)
    kw.update(max_running_requests=8, **overrides)
    return ref, start_engine(model_path=str(path), device="cpu", **kw)


def run_prompts(
    engine, prompts: list[list[int]], n: int, abort_after: dict | None = None
) -> list[tuple[list[int], int]]:
    """Submit every prompt at once (request ids ``r0, r1...``); each one's greedy tokens and cached
    prompt tokens. ``abort_after``: request index -> abort it once it has that many tokens."""
    results, done = [None] * len(prompts), [threading.Event() for _ in prompts]

    def sink_for(i):
        out = []

        def sink(o):
            out.extend(o.token_ids)
            if abort_after and i in abort_after and len(out) >= abort_after[i]:
                engine.abort(f"r{i}")
            if o.finished:
                results[i] = (list(out), o.cached_tokens)
                done[i].set()

        return sink

    for i, ids in enumerate(prompts):
        params = SamplingParams(max_new_tokens=n, min_new_tokens=n, temperature=0)
        engine.submit(GenerateRequest(f"r{i}", ids, params), sink_for(i))
    for ev in done:
        assert ev.wait(300)
    return results


def idle_states(engine) -> dict:
    """The engine's counters, once nothing runs: no state slot stays with a request."""
    stats = engine.call(engine.stats).result(timeout=60)
    assert stats["state_slots_running"] == 0 and stats["num_running_reqs"] == 0
    return stats


def check_step_failing_midway(ref, engine, attention) -> None:
    """A step that raises in ``attention`` (an attention layer after state layers that wrote their
    states): the engine runs its requests again one by one, the others' outputs equal ``generate``
    (their states were not advanced by the failed step) and the culprit fails alone."""
    mark = 509
    good = [[t for t in prompt(20 + i, 9 + 7 * i) if t != mark] for i in range(3)]
    model = engine.runner.model
    real_model, real_attn = model.forward, attention.forward
    culprit = []

    def model_forward(input_ids, positions, ctx):
        culprit[:] = [bool((input_ids == mark).any())]
        return real_model(input_ids, positions, ctx)

    def attn_forward(x, rope, ctx):
        if culprit[0]:
            raise RuntimeError("injected fault after the state layers")
        return real_attn(x, rope, ctx)

    model.forward, attention.forward = model_forward, attn_forward
    try:
        outs = []
        done = [threading.Event() for _ in range(4)]
        for i, ids in enumerate([*good, [5, mark, 7, 9]]):
            out = {"tokens": [], "error": None}
            outs.append(out)

            def sink(o, out=out, ev=done[i]):
                out["tokens"] += o.token_ids
                if o.finished:
                    out["error"] = o.error
                    ev.set()

            params = SamplingParams(max_new_tokens=8, min_new_tokens=8, temperature=0)
            engine.submit(GenerateRequest(f"iso-{i}", ids, params), sink)
        for ev in done:
            assert ev.wait(300)
    finally:
        del model.forward, attention.forward  # (the instance attributes: the class's methods again)
    assert "injected fault" in outs[3]["error"] and not outs[3]["tokens"]
    for ids, out in zip(good, outs):
        assert out["error"] is None
        assert_same_as_generate(ref, ids, out["tokens"], f"{len(ids)}-token prompt beside the culprit")
    idle_states(engine)


def check_batched(ref, engine) -> None:
    """Four prompts of different lengths at once (a one-token prompt and 16-token chunks beside
    decode rows in one step): each one's output equals transformers' alone; no slot stays taken."""
    prompts = [prompt(1, 5), prompt(2, 37), prompt(3, 1), prompt(4, 50)]
    for ids, (ours, _) in zip(prompts, run_prompts(engine, prompts, 10)):
        assert_same_as_generate(ref, ids, ours, f"{len(ids)}-token prompt")
    idle_states(engine)


def check_conversation(ref, engine) -> None:
    """Turn 2 sends turn 1's prompt, its answer and a new message: it resumes from the states
    snapshotted when turn 1 left (all of it but its last token, page-aligned), equal to ``generate``."""
    turn1 = prompt(5, 29)
    ((out1, _),) = run_prompts(engine, [turn1], 8)
    assert_same_as_generate(ref, turn1, out1, "turn 1")
    turn2 = turn1 + out1 + prompt(6, 9)
    ((out2, cached),) = run_prompts(engine, [turn2], 8)
    assert cached == (len(turn1) + len(out1) - 1) // 4 * 4 > 0
    assert_same_as_generate(ref, turn2, out2, "turn 2")
    idle_states(engine)


def check_one_token_prompt(ref, engine) -> None:
    """A one-token prompt on a request row whose slots hold an earlier request's states (a
    decode-shaped step, its row marked fresh) reads zeros, not them."""
    run_prompts(engine, [prompt(8, 23)], 3)
    ((out, _),) = run_prompts(engine, [[17]], 6)
    assert_same_as_generate(ref, [17], out, "one-token prompt")
    idle_states(engine)
