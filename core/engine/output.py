"""Output handling: from sampled tokens to the text each client sees.

The engine loop decides what can be decided from token ids alone (stop ids, EOS, length); this
module owns the rest: detokenizing, stop strings, the reasoning end a constraint waits for, and
emitting :class:`RequestOutput` messages to each request's sink. In the overlap schedule a token
that only its text could end is *deferred*: it is detokenized one step later, while the device
runs the next step.
"""

from __future__ import annotations

import logging
from typing import Callable

from llmkit.core.engine.detokenizer import IncrementalDetokenizer
from llmkit.core.engine.messages import RequestOutput
from llmkit.core.engine.request import Request

log = logging.getLogger("llmkit")

Sink = Callable[[RequestOutput], None]


class Stream:
    """Engine-thread output state of one request."""

    __slots__ = ("req", "sink", "detok", "sent_tokens", "deferred")

    def __init__(self, req: Request, sink: Sink, detok: IncrementalDetokenizer):
        self.req, self.sink, self.detok, self.sent_tokens = req, sink, detok, 0
        self.deferred: int | None = None  # the newest token, not yet detokenized (overlap mode)


class OutputProcessor:
    """The live requests' streams. ``on_finish(req, reason, matched)`` releases a request in the
    scheduler when its text ends it; the processor then emits its final output."""

    def __init__(self, tokenizer, max_context: int, on_finish: Callable[[Request, str, object], None]):
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.on_finish = on_finish
        self.streams: dict[str, Stream] = {}
        self._deferred: list[Stream] = []

    def open(self, req: Request, sink: Sink) -> None:
        p = req.params
        detok = IncrementalDetokenizer(
            self.tokenizer, req.prompt_ids, p.skip_special_tokens, p.stop, p.no_stop_trim, stop_regex=p.stop_regex
        )
        self.streams[req.rid] = Stream(req, sink, detok)

    def get(self, rid: str) -> Stream | None:
        return self.streams.get(rid)

    def defer(self, stream: Stream, tok: int) -> None:
        stream.deferred = tok
        self._deferred.append(stream)

    def finish(self, stream: Stream, reason: str, matched=None) -> None:
        self.on_finish(stream.req, reason, matched)
        self.emit(stream, final=True)

    def fail(self, rid: str, message: str) -> None:
        stream = self.streams.get(rid)
        if stream is not None:
            self.emit(stream, final=True, error=message)

    def process(self, stream: Stream, tok: int) -> None:
        """Feed ``tok`` (the request's newest token) to the detokenizer; finish the request if its
        text, length or grammar says so, stream the new text otherwise."""
        req = stream.req
        p = req.params
        detok = stream.detok
        n_out = len(req.output_ids)
        reasoning_end = req.reasoning_end
        before = len(detok.text) if reasoning_end is not None else 0
        hit = detok.add_token(tok)
        if hit is not None and n_out >= p.min_new_tokens:
            return self.finish(stream, "stop", hit.text)
        if n_out >= p.max_new_tokens or len(req.prompt_ids) + n_out >= self.max_context:
            return self.finish(stream, "length")
        if req.grammar is not None and reasoning_end is None and req.grammar.is_terminated():
            return self.finish(stream, "stop")
        if reasoning_end is not None and reasoning_end.is_reasoning_end(detok.text[before:]):
            req.reasoning_end = None  # reasoning ended: constrain the answer from here on
        self.emit(stream, final=False)

    def process_deferred(self, stream: Stream) -> None:
        """Detokenize ``stream``'s deferred token, if it still has one and is still live."""
        tok, stream.deferred = stream.deferred, None
        if tok is not None and self.streams.get(stream.req.rid) is stream:
            self.guarded(stream.req, self.process, stream, tok)

    def flush_deferred(self) -> None:
        pending, self._deferred = self._deferred, []
        for stream in pending:
            self.process_deferred(stream)

    def guarded(self, req: Request, fn, *args) -> None:
        """Run one request's post-processing; a failure fails only that request."""
        try:
            fn(*args)
        except Exception as exc:
            self.post_processing_failed(req, exc)

    def post_processing_failed(self, req: Request, exc: Exception) -> None:
        """Fail ``req`` alone for ``exc``, raised by its post-processing (call it where caught)."""
        log.exception("post-processing failed for %s", req.rid)
        self.on_finish(req, "abort", None)
        self.fail(req.rid, f"internal error: {exc}")

    def emit(self, stream: Stream, final: bool, error: str | None = None) -> None:
        req = stream.req
        if final:
            if stream.deferred is not None:  # ended from outside (abort, failure): keep its text
                tok, stream.deferred = stream.deferred, None
                stream.detok.add_token(tok)
            stream.detok.flush()
            self.streams.pop(req.rid, None)
        sent = stream.sent_tokens
        first = sent == 0
        out_ids = req.output_ids
        # Positional, in the fields' order: one of these a token a request, and keywords cost
        # twice as much to bind.
        out = RequestOutput(
            req.rid,
            stream.detok.take_delta(final),  # text
            out_ids[sent:],  # token_ids
            req.output_logprobs[sent:] if req.params.logprobs else [],  # logprobs
            final,  # finished
            req.finish_reason if final else None,
            req.matched_stop if final else None,
            len(req.prompt_ids),  # prompt_tokens
            len(out_ids),  # completion_tokens
            req.cached_tokens,
            req.prompt_logprobs if first else None,
            error,
            req.first_scheduled - req.arrival if first and req.first_scheduled is not None else None,  # queue_time
        )
        stream.sent_tokens = len(out_ids)
        try:
            stream.sink(out)
        except Exception:
            log.exception("output sink failed for %s", req.rid)


def step_failure(exc: BaseException, seg) -> str:
    """The error a request gets when its step cannot run, out-of-memory said as such."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":  # torch.cuda's
        return (
            f"out of memory running {seg.length} tokens of this request; lower --chunked-prefill-size "
            "or --max-running-requests"
        )
    return f"internal engine error: {exc}"
