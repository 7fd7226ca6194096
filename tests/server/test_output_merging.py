"""Generation.outputs(): outputs that queued up while the handler was busy come out merged, one
per request (text, tokens and logprobs in order, the last one's totals and end); an error is
never merged away and keeps its place."""

from __future__ import annotations

import asyncio

from llmkit.core.engine.messages import GenerateRequest as Request
from llmkit.core.engine.messages import RequestOutput, SamplingParams, TokenLogprob
from llmkit.core.server.state import Generation


class BurstClient:
    """Yields each request's outputs back to back, without waiting for the consumer."""

    max_queued = 8

    def __init__(self, outputs: dict[str, list[RequestOutput]], gap: float = 0.0) -> None:
        self.outputs = outputs
        self.gap = gap

    def check_capacity(self, n: int = 1) -> None:
        pass

    def release(self, n: int = 1) -> None:
        pass

    async def generate(self, req: Request):
        for out in self.outputs[req.rid]:
            if self.gap:
                await asyncio.sleep(self.gap)
            yield out


def _out(rid: str, k: int, **kw) -> RequestOutput:
    lp = [TokenLogprob(k, -0.1 * k, [(k, -0.1 * k)])]
    return RequestOutput(rid, text=f"t{k}", token_ids=[k], logprobs=lp, completion_tokens=k + 1, **kw)


def _collect(outputs: dict[str, list[RequestOutput]], slow: bool) -> list[tuple[int, RequestOutput]]:
    async def run():
        reqs = [Request(rid, [1, 2], SamplingParams()) for rid in outputs]
        gen = Generation(BurstClient(outputs), reqs)
        got = []
        async for item in gen.outputs():
            got.append(item)
            if slow:  # the handler is busy: everything else queues up meanwhile
                await asyncio.sleep(0.05)
        return got

    return asyncio.run(run())


def test_queued_outputs_merge_per_request_in_order():
    a = [_out("a", k, queue_time=0.5 if k == 0 else None) for k in range(4)]
    a[-1].finished, a[-1].finish_reason = True, "length"
    b = [_out("b", k) for k in range(3)]
    b[0].prompt_logprobs = [None, TokenLogprob(2, -1.0, [])]
    got = _collect({"a": a, "b": b}, slow=True)
    for i, outs in ((0, a), (1, b)):
        mine = [o for j, o in got if j == i]
        assert len(mine) < len(outs)  # some came merged
        assert "".join(o.text for o in mine) == "".join(o.text for o in outs)
        assert [t for o in mine for t in o.token_ids] == [t for o in outs for t in o.token_ids]
        assert [lp.token_id for o in mine for lp in o.logprobs] == [t for o in outs for t in o.token_ids]
        assert mine[-1].completion_tokens == outs[-1].completion_tokens
        assert [o.finished for o in mine].count(True) == (1 if outs[-1].finished else 0)
    first_a = next(o for j, o in got if j == 0)
    first_b = next(o for j, o in got if j == 1)
    assert first_a.queue_time == 0.5 and first_b.prompt_logprobs == b[0].prompt_logprobs
    assert [o.finish_reason for j, o in got if j == 0][-1] == "length"


def test_an_error_keeps_its_place():
    a = [_out("a", 0), _out("a", 1), RequestOutput("a", error="boom", finished=True)]
    got = _collect({"a": a}, slow=True)
    assert [o.error for _, o in got][-1] == "boom"
    assert "".join(o.text for _, o in got) == "t0t1"


def test_a_handler_that_keeps_up_gets_every_output_alone():
    a = [_out("a", k) for k in range(3)]

    async def run():
        gen = Generation(BurstClient({"a": a}, gap=0.02), [Request("a", [1], SamplingParams())])
        return [item async for item in gen.outputs()]

    got = asyncio.run(run())
    assert [o.text for _, o in got] == ["t0", "t1", "t2"]
