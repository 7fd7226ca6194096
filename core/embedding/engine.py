"""``EmbeddingEngine``: one worker thread that embeds (or, for a cross-encoder, scores) the inputs
of concurrent requests together.

Requests hand in token-id lists and get a future; each forward holds at most ``max_batch_tokens``
padded tokens, taken round-robin from the waiting requests, one input from each in turn: every
request gets an equal share of every forward, so a one-input request is served within about one
forward of another client's 2,048 inputs (in arrival order it waited for all of them: 50 s on a
CPU). A request whose future was cancelled (its client went away) has its remaining inputs
dropped before the next forward. Padding is masked, so a vector does not depend on its
batch-mates beyond float noise.

It stands where the generation engine's client stands for the server's plumbing (``/health``,
the drain, ``/get_server_info``), with plain lists of floats crossing back, never tensors.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from llmkit.core.embedding.pooling import Pooling
from llmkit.core.model.encoder import Encoder, Scorer
from llmkit.core.own_thread import ThreadClient, build_and_run

log = logging.getLogger("llmkit")


@dataclass
class _Job:
    inputs: list[list[int]]
    dimensions: int | None  # embeddings: Matryoshka truncation
    future: Future
    type_ids: list[list[int]] | None = None  # scores: each token's segment, where the model reads them
    activate: bool = True  # scores: the model's activation on the logit
    vectors: list = field(default_factory=list)  # the results (vectors or scores), by input
    left: int = 0  # inputs not finished
    # The inputs by length (a forward then holds inputs of similar length, so attention pads
    # little and more fit the budget), and how many of them forwards have taken
    order: list[int] = field(default_factory=list)
    taken: int = 0

    def __post_init__(self) -> None:
        self.vectors = [None] * len(self.inputs)
        self.left = len(self.inputs)
        self.order = sorted(range(len(self.inputs)), key=lambda i: len(self.inputs[i]))
        self.future.tokens = 0  # tokens embedded so far, read when the request is cut short


class EmbeddingEngine(ThreadClient):
    """Serves an :class:`Encoder` (``embed``: pooled vectors) or a :class:`Scorer` (``score``: one
    relevance score per formatted pair); ``kind`` says which."""

    thread_role = "embedding"

    def __init__(
        self,
        model: Encoder | Scorer,
        pooling: Pooling | None,
        *,
        device: str,
        max_input_tokens: int,
        dimensions: tuple[int, ...] | None = None,
        max_batch_tokens: int = 4096,
        pair_template: str | None = None,
        start: bool = True,
    ) -> None:
        self.model = model
        self.kind = "score" if isinstance(model, Scorer) else "embed"
        self.pooling = pooling
        # What the routes check requests against: the longest input, the Matryoshka dimensions
        # (None: ``dimensions`` is refused), the full vector's size; how a pair becomes one input
        # (None: the tokenizer's text pair; else a prompt with {query} and {document}).
        self.max_input_tokens = max_input_tokens
        self.dimensions = dimensions
        self.hidden_size = getattr(model, "hidden_size", None)
        self.pair_template = pair_template
        self.device = device
        self.max_batch_tokens = max_batch_tokens
        self.draining = False  # set by the server on SIGTERM: new requests get 503
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        # Requests with inputs not taken yet, in round-robin order: the next forward starts at the left
        self._waiting: deque[_Job] = deque()
        self._stopped = False
        self._busy_since: float | None = None  # when the current forward started (None: idle)
        self._embedded = 0
        self._dropped = 0  # inputs of requests cut short (client gone) that were never embedded
        self._thread = threading.Thread(target=self._run, name="llmkit-embedding", daemon=True)
        if start:
            self._thread.start()

    @classmethod
    def build_and_start(cls, build: Callable[[], tuple]) -> EmbeddingEngine:
        """``build()`` -> ``(model, pooling, keyword arguments)``, run on the worker thread, which
        then serves (see :mod:`llmkit.core.own_thread`: a model loaded on the caller's thread ran a
        short input in 5.7 ms a forward instead of 3.4); returns the engine once built, or re-raises
        what the build raised."""

        def built() -> EmbeddingEngine:
            model, pooling, kwargs = build()
            engine = cls(model, pooling, start=False, **kwargs)
            engine._thread = threading.current_thread()
            return engine

        return build_and_run("llmkit-embedding", built, lambda engine: engine._run())

    def embed(self, inputs: list[list[int]], dimensions: int | None = None) -> Future:
        """A future of one vector (a list of floats) per input; with ``dimensions``, the first
        that many components, renormalised where the model normalises (Matryoshka)."""
        assert self.kind == "embed", "a cross-encoder scores pairs; it does not embed"
        return self._submit(_Job(inputs, dimensions, Future()))

    def score(self, inputs: list[list[int]], type_ids: list[list[int]] | None = None, activate: bool = True) -> Future:
        """A future of one score per formatted pair: the model's logit, through its activation
        unless ``activate`` is False."""
        assert self.kind == "score", "a bi-encoder embeds; its scores are cosines of its vectors"
        return self._submit(_Job(inputs, None, Future(), type_ids, activate))

    def _submit(self, job: _Job) -> Future:
        if not job.inputs:
            job.future.set_result([])
        else:
            self._jobs.put(job)
        return job.future

    # --- the worker ---------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped:
            self._take_jobs(block=not self._waiting)
            batch = self._next_batch()
            if not batch:
                continue
            self._busy_since = time.monotonic()
            try:
                for (job, i), result in zip(batch, self._forward(batch)):
                    self._finish(job, i, result)
            except Exception as exc:  # a failed forward fails its requests, not the server
                log.exception("embedding forward failed")
                for job, _ in batch:
                    try:
                        job.future.set_exception(exc)
                    except InvalidStateError:  # already cancelled or failed
                        pass
            finally:
                self._busy_since = None

    def _take_jobs(self, block: bool) -> None:
        try:
            job = self._jobs.get(timeout=0.5) if block else self._jobs.get_nowait()
            while True:
                if job is None:  # shutdown
                    return
                self._waiting.append(job)
                job = self._jobs.get_nowait()
        except queue.Empty:
            pass

    def _next_batch(self) -> list[tuple[_Job, int]]:
        """Inputs whose padded size fits the token budget (one at least), one from each waiting
        request in turn. The round-robin order carries over to the next forward, so no request
        is served twice while another waits; a request already answered (cancelled: the client
        went away; or failed) is dropped with its remaining inputs."""
        batch, longest = [], 0
        while self._waiting:
            job = self._waiting[0]
            if job.future.done():
                self._waiting.popleft()
                self._dropped += len(job.order) - job.taken
                continue
            i = job.order[job.taken]
            n = max(longest, len(job.inputs[i]))
            if batch and n * (len(batch) + 1) > self.max_batch_tokens:
                break
            self._waiting.popleft()
            batch.append((job, i))
            job.taken += 1
            longest = n
            if job.taken < len(job.order):
                self._waiting.append(job)
        return batch

    def _forward(self, batch: list[tuple[_Job, int]]) -> list:
        inputs = [job.inputs[i] for job, i in batch]
        if self.kind == "embed":
            return [self._vector(s, job.dimensions) for (job, _), s in zip(batch, self.model.encode(inputs))]
        types = None
        if any(job.type_ids is not None for job, _ in batch):
            types = [job.type_ids[i] if job.type_ids is not None else [0] * len(job.inputs[i]) for job, i in batch]
        logits = self.model.score(inputs, types)
        if self.model.activation == "identity":
            return logits
        activated = torch.sigmoid(torch.tensor(logits, dtype=torch.float64)).tolist()
        return [a if job.activate else x for (job, _), x, a in zip(batch, logits, activated)]

    def _vector(self, states: torch.Tensor, dimensions: int | None) -> list[float]:
        v = self.pooling(states)
        if dimensions is not None:
            v = v[:dimensions]
            if self.pooling.normalize:
                v = F.normalize(v, dim=0)
        return v.tolist()

    def _finish(self, job: _Job, i: int, result) -> None:
        self._embedded += 1
        if job.future.done():
            return
        job.vectors[i] = result
        job.left -= 1
        job.future.tokens += len(job.inputs[i])
        if job.left == 0:
            try:
                job.future.set_result(job.vectors)
            except InvalidStateError:  # cancelled from the event loop since the check above
                pass

    def stats(self) -> dict:
        return {
            "device": self.device,
            "num_waiting_inputs": sum(len(j.order) - j.taken for j in list(self._waiting))
            + sum(len(j.inputs) for j in list(self._jobs.queue) if j is not None),
            "num_embedded_inputs": self._embedded,
            "num_dropped_inputs": self._dropped,
        }

    def shutdown(self) -> None:
        self._stopped = True
        self._jobs.put(None)
        self._thread.join(timeout=30)
