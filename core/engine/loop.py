"""The engine loop: schedule -> prepare -> forward -> sample -> post-process, on its own thread.

Requests arrive through a thread-safe inbox; outputs leave through a per-request sink callback
(called on the engine thread; the client turns them into asyncio events).

Overlap schedule (default on CUDA): while step N runs on the device, the CPU plans step N+1 (the
scheduler counts the token in flight; it never touches the device) and post-processes step N-1's
tokens. Step N's tokens are then read back (the one sync per step), checked against the cheap
finish conditions (stop ids, EOS, length) at once, and step N+1 is launched without the requests
that just finished. Detokenization, stop strings and streaming for step N wait until step N+1 is
running, so a stop string is seen one step late: that request joins one more forward, whose token
is dropped. Outputs are the same as without overlap.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.detokenizer import IncrementalDetokenizer
from llmkit.core.engine.request import Request, Status, TokenLogprob
from llmkit.core.engine.sampler import Sampler, make_generator, token_logprob

log = logging.getLogger("llmkit")


@dataclass
class RequestOutput:
    rid: str
    text: str = ""  # new text since the previous output
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None


Sink = Callable[[RequestOutput], None]


class _Live:
    """Engine-thread state of one request."""

    __slots__ = ("req", "sink", "detok", "sent_tokens", "deferred")

    def __init__(self, req: Request, sink: Sink, detok: IncrementalDetokenizer):
        self.req, self.sink, self.detok, self.sent_tokens = req, sink, detok, 0
        self.deferred: int | None = None  # the newest token, not yet detokenized (overlap mode)


class Engine:
    def __init__(self, config: EngineConfig, parts) -> None:
        """``parts`` is a :class:`llmkit.core.engine.builder.EngineParts`."""
        self.config = config
        self.tokenizer = parts.tokenizer
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.sampler = Sampler(parts.vocab_size)
        self.eos_token_ids = parts.eos_token_ids
        self.max_context = parts.max_context
        self.vocab_size = parts.vocab_size
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        overlap = config.overlap_schedule
        self.overlap = parts.runner.device.type == "cuda" if overlap is None else overlap
        self._deferred: list[_Live] = []
        self._inflight = None  # (batch, step output) launched and not yet sampled (overlap mode)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_step = time.monotonic()
        self.steps = 0
        # stats for the logs
        self._decode_tokens = 0
        self._decode_since = time.monotonic()
        self._decode_steps = 0
        self._prompt_tokens_total = 0
        self._cached_tokens_total = 0

    # -- API (any thread) ----------------------------------------------------------------------
    def submit(self, req: Request, sink: Sink) -> None:
        self._inbox.put(("add", req, sink))

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid, None))

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="llmkit-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", None, None))
        if self._thread is not None:
            self._thread.join(timeout=30)

    # -- the loop (engine thread) ----------------------------------------------------------------
    def _run(self) -> None:
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        while not self._stop.is_set():
            try:
                self._drain(block=not self.has_work)
                if self.has_work:
                    self.step()
            except Exception as exc:  # a bug must not leave clients hanging forever
                log.exception("engine step failed")
                self._inflight = None
                self._fail_all(f"internal engine error: {exc}")
            self.last_step = time.monotonic()

    def _drain(self, block: bool) -> None:
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
            req: Request = a
            if req.generator is None and not req.params.greedy:
                req.generator = make_generator(req.params.seed, self.runner.device)
            req.eos_token_ids = self.eos_token_ids
            detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, req.params.skip_special_tokens,
                                           req.params.stop, req.params.no_stop_trim,
                                           stop_regex=req.params.stop_regex)
            self._live[req.rid] = _Live(req, b, detok)
            self.scheduler.add(req)
        elif kind == "abort":
            live = self._live.get(a)
            if live is not None:
                self._finish_deferred(live)  # may itself finish it (a stop string)
            if a in self._live:
                self.scheduler.abort(a)
                self._emit(live, final=True)

    def _fail(self, req: Request, message: str) -> None:
        """End ``req`` with finish_reason "abort" and ``message`` as its error, wherever it is."""
        self.scheduler.abort(req.rid)
        live = self._live.get(req.rid)
        if live is not None:
            self._emit(live, final=True, error=message)

    def _fail_all(self, message: str) -> None:
        for live in list(self._live.values()):
            self._fail(live.req, message)

    def step(self) -> None:
        if not self.overlap:
            batch = self.scheduler.schedule()
            if batch is not None:
                self._complete(batch, self._launch(batch))
            return
        # Overlap: while step N computes, plan step N+1 and post-process step N-1; then read
        # step N's tokens back and launch N+1 without N's finished requests.
        if self._inflight is None:
            batch = self.scheduler.schedule()
            if batch is None:
                self._flush_deferred()
                return
            self._inflight = (batch, self._launch(batch))
        (batch, out), self._inflight = self._inflight, None
        nxt = self.scheduler.schedule()
        self._flush_deferred()
        self._complete(batch, out)
        if nxt is not None:
            nxt.segments = [s for s in nxt.segments if s.req.status is Status.RUNNING]
            if nxt.segments:
                self._inflight = (nxt, self._launch(nxt))

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None

    def _launch(self, batch):
        out = self.runner.run(batch)  # on CUDA this returns once the kernels are queued
        self.scheduler.on_step_done(batch)
        self.steps += 1
        for seg in out.sample_segments:
            seg.req.inflight = True
        return out

    def _complete(self, batch, out) -> None:
        """Sample the launched step's tokens (the device sync) and post-process them."""
        if out.prompt_logits:
            self._record_prompt_logprobs(out.prompt_logits)
        # Counted before the new tokens are appended (which moves each sequence's end).
        n_decode = sum(1 for s in out.sample_segments if s.length == 1)
        if out.sample_segments:
            reqs = [s.req for s in out.sample_segments]
            tokens, logprobs = self.sampler.sample(out.sample_logits, reqs)
            for i, (req, tok, lp) in enumerate(zip(reqs, tokens, logprobs)):
                req.inflight = False
                if req.rid not in self._live:
                    continue  # ended (abort, deferred stop string) after this step was launched
                if i in self.sampler.failed:
                    self._fail(req, self.sampler.failed[i])
                    continue
                try:
                    self._append_token(req, tok, lp)
                except Exception as exc:  # post-processing of one request fails only that request
                    log.exception("post-processing failed for %s", req.rid)
                    self._fail(req, f"internal error: {exc}")
        self._log(batch, n_decode)

    def _record_prompt_logprobs(self, prompt_logits) -> None:
        for rid, (start, logits) in prompt_logits.items():
            live = self._live.get(rid)
            if live is None:
                continue
            req = live.req
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None]  # the first prompt token has no logprob
            lp = torch.log_softmax(logits[:, : self.vocab_size], dim=-1)
            ids = req.prompt_ids
            for j in range(lp.shape[0]):
                nxt = start + j + 1
                if nxt < len(ids):
                    req.prompt_logprobs.append(token_logprob(lp[j], ids[nxt], req.params.top_logprobs))

    def _append_token(self, req: Request, tok: int, lp: TokenLogprob | None) -> None:
        live = self._live[req.rid]
        p = req.params
        req.output_ids.append(tok)
        if lp is not None:
            req.output_logprobs.append(lp)
        if req.grammar_active:
            req.grammar.accept_token(tok)
        n_out = len(req.output_ids)
        if tok in p.stop_token_ids and n_out >= p.min_new_tokens:
            self._finish(live, "stop", tok)
        elif tok in req.eos_token_ids and not p.ignore_eos and n_out >= p.min_new_tokens:
            self._finish(live, "stop", tok)
        elif (self.overlap and req.grammar_wait_for is None and n_out < p.max_new_tokens
              and req.seq_len < self.max_context and not (req.grammar_active and req.grammar.is_terminated())):
            live.deferred = tok  # nothing but the text can end it now: look at that next step
            self._deferred.append(live)
        else:
            self._detokenize(live, tok)

    def _detokenize(self, live: _Live, tok: int) -> None:
        """Feed ``tok`` (the request's newest token) to the detokenizer and finish the request
        if its text, length or grammar says so; stream the new text otherwise."""
        req, p = live.req, live.req.params
        n_out = len(req.output_ids)
        reason, matched = None, None
        hit = live.detok.add_token(tok)
        if hit is not None and n_out >= p.min_new_tokens:
            reason, matched = "stop", hit.text
        elif n_out >= p.max_new_tokens or req.seq_len >= self.max_context:
            reason = "length"
        elif req.grammar_active and req.grammar.is_terminated():
            reason = "stop"
        elif req.grammar_wait_for is not None and req.grammar_wait_for in live.detok.text:
            req.grammar_wait_for = None  # reasoning ended: constrain the answer from here on
        if reason is not None:
            self._finish(live, reason, matched)
        else:
            self._emit(live, final=False)

    def _finish(self, live: _Live, reason: str, matched=None) -> None:
        self.scheduler.finish(live.req, reason, matched)
        self._emit(live, final=True)

    def _finish_deferred(self, live: _Live) -> None:
        tok, live.deferred = live.deferred, None
        if tok is not None and self._live.get(live.req.rid) is live:
            try:
                self._detokenize(live, tok)
            except Exception as exc:
                log.exception("post-processing failed for %s", live.req.rid)
                self._fail(live.req, f"internal error: {exc}")

    def _flush_deferred(self) -> None:
        pending, self._deferred = self._deferred, []
        for live in pending:
            self._finish_deferred(live)

    def _emit(self, live: _Live, final: bool, error: str | None = None) -> None:
        req = live.req
        if final:
            if live.deferred is not None:  # ended from outside (abort, failure): keep its text
                tok, live.deferred = live.deferred, None
                live.detok.add_token(tok)
            live.detok.flush()
            self._live.pop(req.rid, None)
        new_tokens = req.output_ids[live.sent_tokens :]
        new_lps = req.output_logprobs[live.sent_tokens :] if req.params.logprobs else []
        first = live.sent_tokens == 0
        live.sent_tokens = len(req.output_ids)
        out = RequestOutput(
            rid=req.rid,
            text=live.detok.take_delta(final),
            token_ids=new_tokens,
            logprobs=new_lps,
            finished=final,
            finish_reason=req.finish_reason if final else None,
            matched_stop=req.matched_stop if final else None,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            prompt_logprobs=req.prompt_logprobs if first else None,
            error=error,
        )
        try:
            live.sink(out)
        except Exception:
            log.exception("output sink failed for %s", req.rid)

    # -- logs ----------------------------------------------------------------------------------
    def _log(self, batch, n_decode: int) -> None:
        sched = self.scheduler
        if batch.num_new_prefill_seqs:
            self._prompt_tokens_total += batch.num_prefill_tokens + batch.num_cached_tokens
            self._cached_tokens_total += batch.num_cached_tokens
            rate = 100.0 * self._cached_tokens_total / max(1, self._prompt_tokens_total)
            log.info(
                "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, cache hit rate: %.2f%%, "
                "token usage: %.2f, #running-req: %d, #queue-req: %d",
                batch.num_new_prefill_seqs, batch.num_prefill_tokens, batch.num_cached_tokens, rate,
                sched.token_usage(), batch.num_running_before, len(sched.waiting),
            )
        self._decode_tokens += n_decode
        if n_decode:
            self._decode_steps += 1
        if self._decode_steps >= self.config.decode_log_interval:
            now = time.monotonic()
            tps = self._decode_tokens / max(1e-9, now - self._decode_since)
            n_tok = sum(r.seq_len for r in sched.running)
            log.info(
                "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
                "#queue-req: %d", len(sched.running), n_tok, sched.token_usage(), tps, len(sched.waiting),
            )
            self._decode_tokens, self._decode_steps, self._decode_since = 0, 0, now

    # -- introspection -----------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters for /get_server_info; ``kv_pages_in_use`` is 0 whenever nothing runs."""
        sched = self.scheduler
        pool, cache = sched.pool, sched.cache
        free, cached = pool.num_free_pages, cache.evictable_pages
        return {
            "num_running_reqs": len(sched.running), "num_waiting_reqs": len(sched.waiting),
            "kv_pages_total": pool.capacity_pages, "kv_pages_free": free, "kv_pages_cached": cached,
            "kv_pages_in_use": pool.capacity_pages - free - cached, "page_size": pool.page_size,
            "steps": self.steps, "last_step_age_s": time.monotonic() - self.last_step,
            "preemptions": sched.num_preemptions, "overlap_schedule": self.overlap,
        }
