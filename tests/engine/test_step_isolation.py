"""A step whose forward raises fails only the request that makes it fail: the engine runs the
step's requests one by one, fails the culprit with a clear error, and the others finish with the
same tokens as if it had never been there (fault injected into the forward for one request)."""

from __future__ import annotations

import threading

import pytest

from llmkit.core.engine.messages import GenerateRequest, SamplingParams

from model_utils import start_engine

MARK = 4242  # a prompt holding this token id makes the forward raise


def _run(engine, prompts: dict[str, list[int]]) -> dict:
    done, outs = threading.Event(), {rid: {"tokens": [], "error": None} for rid in prompts}
    left = set(prompts)

    def sink_for(rid):
        def sink(o):
            outs[rid]["tokens"] += o.token_ids
            if o.finished:
                outs[rid]["error"] = o.error
                left.discard(rid)
                if not left:
                    done.set()

        return sink

    for rid, ids in prompts.items():
        params = SamplingParams(max_new_tokens=12, min_new_tokens=12, temperature=0)
        engine.submit(GenerateRequest(rid, ids, params), sink_for(rid))
    assert done.wait(300)
    return outs


@pytest.mark.parametrize("error", [RuntimeError("injected kernel fault"), MemoryError()])
def test_a_failing_forward_fails_only_its_culprit(error):
    engine = start_engine(enable_deterministic_inference=True)  # a request's tokens do not depend on its batch
    good = {f"good-{i}": [1, 510 + 37 * i, 2020 + i, 88, 90 + i] for i in range(3)}
    try:
        alone = _run(engine, good)
        real = engine.runner.run

        def run(batch, prev=None):
            if any(MARK in s.req.prompt_ids for s in batch.segments):
                raise error
            return real(batch, prev)

        engine.runner.run = run
        both = _run(engine, {**{f"again-{k}": v for k, v in good.items()}, "bad": [1, MARK, 77]})
        assert engine.is_alive()
    finally:
        engine.shutdown()
    assert both["bad"]["error"] and not both["bad"]["tokens"]
    assert ("out of memory" if isinstance(error, MemoryError) else "injected kernel fault") in both["bad"]["error"]
    for rid, out in alone.items():
        assert out["error"] is None and both[f"again-{rid}"] == out, rid
