"""A request joining the engine: refused before it can join a batch (a request the forward
cannot take would fail the whole step, and every request batched with it), else opened for
output, given its sampling generator, adapter and grammar matcher, and queued. ``engine`` is the
:class:`~llmkit.core.engine.loop.Engine`, on its own thread."""

from __future__ import annotations

from llmkit.core.engine.messages import GenerateRequest
from llmkit.core.engine.output import Sink
from llmkit.core.engine.request import Request, Status
from llmkit.core.engine.sampler import make_generator
from llmkit.core.grammar.contract import GrammarError
from llmkit.core.parsing.reasoning import ReasoningEndScanner


def refusal_of(engine, msg: GenerateRequest) -> str | None:
    """Why ``msg`` cannot join a batch, checked before it does: a request the forward cannot
    take would otherwise fail the whole step, and every request batched with it."""
    ids = msg.prompt_ids
    if len(ids) == 0:
        return "the prompt has no tokens"
    if msg.lora is not None and (engine.runner.lora is None or engine.runner.lora.get(msg.lora) is None):
        return f"the LoRA adapter '{msg.lora}' is not loaded"
    if min(ids) < 0 or max(ids) >= engine.vocab_size:
        return f"prompt token ids must be in [0, {engine.vocab_size})"
    if msg.mm is not None:
        if engine.runner.encoder is None:
            return "this model does not take images"
        if msg.return_prompt_logprobs:  # an image's tokens have no logprob to report
            return "prompt logprobs are not served for prompts with images"
        if any(off < 0 or off + n > len(ids) for off, n in msg.mm.spans):
            return "an image's tokens lie outside the prompt"
    return None


def admit(engine, msg: GenerateRequest, sink: Sink) -> None:
    """``msg`` joins the engine's queue, or ends at once with its refusal as the error."""
    req = Request.from_message(msg, engine.eos_token_ids)
    refusal = refusal_of(engine, msg)
    if refusal is None and msg.lora is not None:
        req.lora = engine.runner.lora.get(msg.lora)
    if refusal is not None:  # the server checks this first; this is a backstop for any client
        engine.output.open(req, sink)
        req.status, req.finish_reason = Status.FINISHED, "abort"
        return engine.output.fail(req.rid, refusal)
    if not req.params.greedy:
        req.generator = make_generator(req.params.seed, engine.runner.device)
    engine.output.open(req, sink)
    if msg.grammar is not None:
        try:
            # a cache hit: the server compiled it before submitting
            req.grammar = engine.grammar.compile(msg.grammar).new_matcher()
        except GrammarError as exc:  # the server checks constraints first; this is a backstop
            req.status, req.finish_reason = Status.FINISHED, "abort"
            return engine.output.fail(req.rid, f"{exc.param}: {exc.message}")
        if msg.grammar_after:
            req.reasoning_end = ReasoningEndScanner(msg.grammar_after)
    engine.scheduler.add(req)
