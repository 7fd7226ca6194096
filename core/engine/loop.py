"""The engine loop: schedule -> launch -> update, on its own thread.

Requests arrive as :class:`GenerateRequest` messages through a thread-safe inbox; outputs leave as
:class:`RequestOutput` messages through a per-request sink (called on the engine thread; the
client turns them into asyncio events). The loop decides what token ids alone decide (stop ids,
EOS, length); :class:`OutputProcessor` owns detokenizing, stop strings and emitting. The engine
owns its grammar backend: it compiles each request's constraint and keeps the matcher.

Overlap schedule (default on CUDA): while step N runs on the device, the CPU plans step N+1 (the
scheduler counts the token in flight; it never touches the device) and post-processes step N-1's
tokens. Where step N's rows need nothing from the host to be sampled (no penalties, bias, grammar
or minimum length), its sampling was queued with it and step N+1 is launched at once, its decode
inputs copied on the device from N's picks: the device goes from N to N+1 without waiting for the
host. Otherwise step N's tokens are read back first. Either way they are then checked against the
cheap finish conditions (stop ids, EOS, length); requests that end by length never join N+1, and
detokenization, stop strings and streaming for step N wait until step N+1 is running, so a stop
token or string can be seen one step late: that request joins one more forward, whose token is
dropped. Outputs are the same as without overlap.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch

from llmkit.core.engine.admission import admit
from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.messages import GenerateRequest, RequestOutput
from llmkit.core.engine.output import OutputProcessor, Sink, step_failure
from llmkit.core.engine.request import Request, Status, TokenLogprob
from llmkit.core.engine.sampler import PendingSample, Sampler
from llmkit.core.engine.scheduling.scheduled_batch import ScheduledBatch
from llmkit.core.engine.stages.warmup import warm_up
from llmkit.core.engine.stats import EngineStats, engine_counters
from llmkit.core.own_thread import build_and_run
from llmkit.core.speculative.verify import verify_drafted

log = logging.getLogger("llmkit")

__all__ = ["Engine", "RequestOutput", "Sink"]


@dataclass
class Launched:
    """A step whose forward has been queued and whose tokens are not yet read back."""

    batch: Any
    out: Any
    pending: PendingSample | None = None  # its sampling, queued too (overlap, plain rows only)


class Engine:
    def __init__(self, config: EngineConfig, parts) -> None:
        """``parts`` is a :class:`llmkit.core.engine.builder.EngineParts`."""
        self.config = config
        self.tokenizer = parts.tokenizer
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.grammar = parts.grammar  # the grammar plugin's backend (``none``'s refuses every constraint)
        self.sampler = Sampler(parts.vocab_size, self.grammar)
        self.eos_token_ids = parts.eos_token_ids
        self.max_context = parts.max_context
        self.vocab_size = parts.vocab_size
        self.output = OutputProcessor(self.tokenizer, self.max_context, self._release)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        overlap = config.overlap_schedule
        self.overlap = parts.runner.device.type == "cuda" if overlap is None else overlap
        self.speculator = parts.scheduler.speculator
        if self.speculator is not None and self.overlap:
            # A step's drafts come from the tokens the step before accepted: nothing to overlap.
            log.info("speculative decoding: the overlap schedule is off")
            self.overlap = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_step = time.monotonic()
        self.steps = 0
        self.chained_steps = 0  # steps launched from the device's picks, before the host read them
        self.log_stats = EngineStats(config.decode_log_interval)

    # -- API (any thread) ----------------------------------------------------------------------
    def submit(self, msg: GenerateRequest, sink: Sink) -> None:
        self._inbox.put(("add", msg, sink))

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid, None))

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the engine thread between steps (LoRA loading and unloading); its result
        or exception arrives in the returned future."""
        fut: Future = Future()
        self._inbox.put(("call", fn, fut))
        return fut

    def flush_cache(self, done: Callable[[bool], None]) -> None:
        """Drop the prefix cache (SGLang's ``/flush_cache``) on the engine thread, between steps;
        ``done(flushed)`` is called there, with False while requests run or wait (as SGLang)."""
        self._inbox.put(("flush", done, None))

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._warm_up_if_configured()
        self._thread = threading.Thread(target=self._run, name="llmkit-engine", daemon=True)
        self._thread.start()

    def _warm_up_if_configured(self) -> None:
        warm = self.config.warmup
        if warm or (warm is None and self.runner.device.type == "cuda"):
            warm_up(self)

    @classmethod
    def build_and_start(cls, config: EngineConfig, build: Callable[[], Any]) -> tuple[Engine, Any]:
        """``build()`` the parts (an ``EngineParts``) and run the engine, both on the engine thread
        (see :mod:`llmkit.core.own_thread`); returns ``(engine, parts)`` once built, or re-raises
        what the build raised."""

        def built() -> tuple[Engine, Any]:
            if config.num_threads:
                torch.set_num_threads(config.num_threads)
            parts = build()
            engine = cls(config, parts)
            engine._warm_up_if_configured()  # before the server reports ready
            engine._thread = threading.current_thread()
            return engine, parts

        return build_and_run("llmkit-engine", built, lambda got: got[0]._run())

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", None, None))
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._thread is None or not self._thread.is_alive():
            self.runner.close()  # other tensor-parallel ranks leave their loop (not mid-step)
        if self.grammar is not None:
            self.grammar.close()
        if self.scheduler.tier is not None:  # (its queued writes finish first: a restart finds them)
            self.scheduler.tier.close()

    # -- the loop (engine thread) ----------------------------------------------------------------
    def _run(self) -> None:
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        inflight: Launched | None = None
        while not self._stop.is_set():
            try:
                self.drain(block=not self.has_work(inflight))
                if self.has_work(inflight):
                    inflight = self.step(inflight)
                self.runner.keep_alive()  # (a clock read, unless idle under tensor parallelism)
            except Exception as exc:  # a bug must not leave clients hanging forever
                log.exception("engine step failed")
                inflight = None
                self._fail_all(f"internal engine error: {exc}")
            self.last_step = time.monotonic()

    # drain, add, has_work, fail and append_token run on the engine thread: the loop's, or the
    # caller's before the loop runs (the warm-up, benchmarks that call step themselves).
    def drain(self, block: bool = False) -> None:
        """Handle every message in the inbox (requests, aborts, calls, flushes); ``block``: wait
        up to 0.5 s for the first one."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item) -> None:
        kind, a, b = item
        if kind == "add":
            self.add(a, b)
        elif kind == "call":
            try:
                b.set_result(a())
            except Exception as exc:  # noqa: BLE001 (handed to the caller)
                b.set_exception(exc)
        elif kind == "flush":
            idle = not (self.scheduler.running or self.scheduler.waiting)
            if idle:
                self.scheduler.cache.reset()
            a(idle)
        elif kind == "abort":
            stream = self.output.get(a)
            if stream is not None:
                self.output.process_deferred(stream)  # may itself finish it (a stop string)
            if self.output.get(a) is not None:
                self.scheduler.abort(a)
                self.output.emit(stream, final=True)

    def add(self, msg: GenerateRequest, sink: Sink) -> None:
        """Admit ``msg`` now (from another thread: :meth:`submit`)."""
        admit(self, msg, sink)

    def _release(self, req: Request, reason: str, matched) -> None:
        """The output processor ended ``req``: give its KV pages back."""
        if reason == "abort":
            self.scheduler.abort(req.rid)
        else:
            self.scheduler.finish(req, reason, matched)

    def fail(self, req: Request, message: str) -> None:
        """End ``req`` with finish_reason "abort" and ``message`` as its error, wherever it is."""
        self.scheduler.abort(req.rid)
        self.output.fail(req.rid, message)

    def _fail_all(self, message: str) -> None:
        for stream in list(self.output.streams.values()):
            self.fail(stream.req, message)

    def step(self, inflight: Launched | None = None) -> Launched | None:
        """Run one engine step; returns the step left running on the device (overlap mode)."""
        if not self.overlap:
            batch = self.scheduler.schedule()
            launched = self._launch_isolating(batch) if batch is not None else None
            if launched is not None:
                self._update(launched)
            return None
        # Overlap: while step N computes, plan step N+1 and post-process step N-1; then read
        # step N's tokens back and launch N+1 without N's finished requests.
        if inflight is None:
            batch = self.scheduler.schedule()
            if batch is None:
                self.output.flush_deferred()
                return None
            inflight = self._launch_isolating(batch)
            if inflight is None:
                return None
        nxt = self.scheduler.schedule()
        self.output.flush_deferred()
        chained = self._launch_chained(nxt, inflight) if nxt is not None and inflight.pending else None
        self._update(inflight)
        if chained is not None:
            for seg in chained.out.sample_segments:
                seg.req.inflight = True  # (the update just cleared it: its token is in flight again)
            return chained
        if nxt is not None:
            nxt.segments = [s for s in nxt.segments if s.req.status is Status.RUNNING]
            if nxt.segments:
                return self._launch_isolating(nxt)
        return None

    def has_work(self, inflight: Launched | None = None) -> bool:
        """Whether a request is running or waiting, or a step (``inflight``) is left on the device."""
        return self.scheduler.has_work or inflight is not None

    def _launch_isolating(self, batch) -> Launched | None:
        """Launch ``batch``; if its forward raises (a request's bad state, an out-of-memory on a
        large prefill, a kernel error), run each of its requests alone instead, so that only the
        one(s) that fail alone are failed and the others go on. None: the step was isolated (its
        requests have advanced or failed; nothing is left running)."""
        try:
            return self._launch(batch)
        except Exception as exc:  # noqa: BLE001 - attributed below, request by request
            if len(batch.segments) > 1:
                log.warning("a step of %d requests failed (%s); running each alone", len(batch.segments), exc)
            failure = exc
        for seg in batch.segments:
            req = seg.req
            if req.status is not Status.RUNNING or self.output.get(req.rid) is None:
                continue
            try:
                launched = self._launch(ScheduledBatch([seg])) if len(batch.segments) > 1 else None
            except Exception as exc:  # noqa: BLE001 - this request's own failure
                failure = exc
                launched = None
            if launched is None:
                log.error("request %s failed its step: %s", req.rid, failure, exc_info=failure)
                self.fail(req, step_failure(failure, seg))
            else:
                self._update(launched)
        return None

    def _launch_chained(self, nxt, inflight: Launched) -> Launched | None:
        """Launch ``nxt`` before ``inflight``'s tokens reach the host, its decode inputs copied on
        the device from ``inflight``'s picks, so the device never waits for the host's update of
        a step. Requests that the update will end by length are left out; one that ends on a stop
        token or string joins this step and its token is dropped (as with a deferred stop string).
        None: launch after the update instead."""
        pending = inflight.pending
        ends = {
            id(r)
            for r in pending.reqs
            if len(r.output_ids) + 1 >= r.params.max_new_tokens or r.seq_len + 1 >= self.max_context
        }
        nxt.segments = [s for s in nxt.segments if s.req.status is Status.RUNNING and id(s.req) not in ends]
        if not nxt.segments:
            return None
        try:
            launched = self._launch(nxt, pending)
            self.chained_steps += 1
            return launched
        except Exception as exc:  # noqa: BLE001 - run again after the update, request by request
            log.warning("a chained step failed to launch (%s); launching it after the update", exc)
            return None

    def _launch(self, batch, prev: PendingSample | None = None) -> Launched:
        out = self.runner.run(batch, prev)  # on CUDA this returns once the kernels are queued
        self.scheduler.on_step_done(batch)
        self.steps += 1
        segs = out.sample_segments
        for seg in segs:
            seg.req.inflight = True
        pending = None
        if self.overlap and segs and self.runner.can_chain and not any(s.draft for s in segs):
            pending = self.sampler.launch(out.sample_logits, [s.req for s in segs])
        return Launched(batch, out, pending)

    def _update(self, step: Launched) -> None:
        """Sample the launched step's tokens (the device sync) and apply them."""
        out = step.out
        if out.prompt_logits:
            self._record_prompt_logprobs(out.prompt_logits)
        segs, logits = out.sample_segments, out.sample_logits
        # Counted before the new tokens are appended (which moves each sequence's end).
        if step.batch.decode_only:  # (every segment one token, no draft)
            n_decode = len(segs)
        else:
            n_decode = sum(1 for s in segs if s.length == 1)
            if any(s.draft for s in segs):  # rows per segment differ: verify the drafted ones
                emitted, segs, logits = verify_drafted(self, segs, logits)
                n_decode += emitted
        if segs:
            reqs = [s.req for s in segs]
            if step.pending is not None:
                tokens, logprobs = self.sampler.finish(step.pending)
            else:
                tokens, logprobs = self.sampler.sample(logits, reqs)
            self._append_tokens(reqs, tokens, logprobs)
        self.log_stats.on_step(step.batch, self.scheduler, n_decode)

    def _append_tokens(self, reqs: list[Request], tokens: list[int], logprobs: list) -> None:
        """Append each request's sampled token (one pass over the batch: per request only what its
        token needs)."""
        failed = self.sampler.failed
        get = self.output.streams.get
        append = self._append
        for i, req in enumerate(reqs):
            req.inflight = False
            stream = get(req.rid)
            if stream is None:
                continue  # ended (abort, deferred stop string) after this step was launched
            if failed and i in failed:
                self.fail(req, failed[i])
                continue
            try:
                append(stream, req, tokens[i], logprobs[i])
            except Exception as exc:  # a failure fails only this request (as OutputProcessor.guarded)
                self.output.post_processing_failed(req, exc)

    def _record_prompt_logprobs(self, prompt_logits) -> None:
        for rid, (start, logits) in prompt_logits.items():
            stream = self.output.get(rid)
            if stream is None:
                continue
            self.sampler.add_prompt_logprobs(stream.req, start, logits)

    def append_token(self, req: Request, tok: int, lp: TokenLogprob | None) -> None:
        """Append ``req``'s next token ``tok`` (sampled or a kept draft token) and apply what it
        decides: a stop, the length limit, the text's checks."""
        self._append(self.output.get(req.rid), req, tok, lp)

    def _append(self, stream, req: Request, tok: int, lp: TokenLogprob | None) -> None:
        p = req.params
        out = req.output_ids
        out.append(tok)
        if lp is not None:
            req.output_logprobs.append(lp)
        grammar = req.grammar if req.reasoning_end is None else None  # (req.grammar_active, inline)
        if grammar is not None:
            grammar.accept_token(tok)
        n_out = len(out)
        if (tok in p.stop_token_ids or (tok in req.eos_token_ids and not p.ignore_eos)) and n_out >= p.min_new_tokens:
            self.output.finish(stream, "stop", tok)
        elif (
            self.overlap
            and req.reasoning_end is None
            and n_out < p.max_new_tokens
            and len(req.prompt_ids) + n_out < self.max_context
            and not (grammar is not None and grammar.is_terminated())
        ):
            self.output.defer(stream, tok)  # nothing but the text can end it now: look next step
        else:
            self.output.process(stream, tok)

    # -- introspection -----------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters for /get_server_info (see :func:`~llmkit.core.engine.stats.engine_counters`)."""
        return engine_counters(self)
