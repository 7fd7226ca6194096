"""``SpeechEngine``: one worker thread that transcribes (or translates) uploaded audio with a
speech-to-text model, one request at a time, its 30 s windows decoded together in batches.

The shape of :class:`llmkit.core.embedding.engine.EmbeddingEngine`: built and run on its own
thread (``own_thread``), requests hand in samples and get a future, and the server's plumbing
(``/health``, the drain, ``/get_server_info``) asks it what it asks an engine client. Each window's
text is also handed to the request's ``on_window`` callback as soon as it is decoded (streaming).
Serving Whisper's decoder under the engine's continuous batching, its K/V in the engine's pools,
is a later step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from llmkit.core.audio.features import WhisperFeatures
from llmkit.core.own_thread import ThreadClient, build_and_run
from llmkit.core.speech.greedy import decode_windows
from llmkit.core.speech.model import SpeechToText
from llmkit.core.speech.prompt import WhisperPrompt

log = logging.getLogger("llmkit")


@dataclass(frozen=True)
class Segment:
    """One window's text: Whisper without timestamp tokens knows no finer times than its window."""

    start: float
    end: float
    tokens: list[int]
    text: str


@dataclass(frozen=True)
class Transcript:
    text: str
    language: str | None  # the code of the language decoded in (given, or detected on the first window)
    duration: float
    segments: list[Segment]


@dataclass
class _Job:
    samples: np.ndarray
    task: str
    language: str | None
    previous: list[int]
    temperature: float
    future: Future
    on_window: Callable[[Segment], None] | None = None
    segments: list[Segment] = field(default_factory=list)


class SpeechEngine(ThreadClient):
    thread_role = "speech"

    def __init__(
        self,
        model: SpeechToText,
        features: WhisperFeatures,
        prompt: WhisperPrompt,
        detokenize: Callable[[list[int]], str],
        *,
        device: str,
        max_batch_windows: int = 8,
        start: bool = True,
    ) -> None:
        self.model, self.features, self.prompt = model, features, prompt
        self.detokenize = detokenize
        self.device = device
        self.max_batch_windows = max_batch_windows
        self.sample_rate = features.sample_rate
        self.draining = False  # set by the server on SIGTERM: new requests get 503
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._stopped = False
        self._busy_since: float | None = None
        self._transcribed = 0
        self._thread = threading.Thread(target=self._run, name="llmkit-speech", daemon=True)
        if start:
            self._thread.start()

    @classmethod
    def build_and_start(cls, build: Callable[[], SpeechEngine]) -> SpeechEngine:
        """``build()`` -> an engine not started, run on the worker thread that then serves it (a
        model built on one thread and run on another pays for two OpenMP teams: own_thread.py)."""

        def built() -> SpeechEngine:
            engine = build()
            engine._thread = threading.current_thread()
            return engine

        return build_and_run("llmkit-speech", built, lambda engine: engine._run())

    def transcribe(
        self,
        samples: np.ndarray,
        *,
        task: str = "transcribe",
        language: str | None = None,
        previous: list[int] = (),
        temperature: float = 0.0,
        on_window: Callable[[Segment], None] | None = None,
    ) -> Future:
        """A future of a :class:`Transcript` of ``samples`` (mono, at ``sample_rate``); ``language``
        a code the model knows (None: detected), ``previous`` the prompt's tokens. Checks the
        task and language here, so a bad one is the caller's ValueError, not a failed future."""
        code = self.prompt.language_code(language)
        self.prompt.prefix(task, code)  # raises for a task the model lacks
        job = _Job(samples, task, code, list(previous)[-(self.prompt.max_length // 2 - 1) :], temperature, Future())
        job.on_window = on_window
        self._jobs.put(job)
        return job.future

    # --- the worker ---------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped:
            try:
                job = self._jobs.get(timeout=0.5)
            except queue.Empty:
                continue
            if job is None:
                return
            if job.future.cancelled():
                continue
            self._busy_since = time.monotonic()
            try:
                transcript = self._transcribe(job)
                self._transcribed += 1
                if not job.future.done():  # (cancelled meanwhile: its client went away)
                    job.future.set_result(transcript)
            except InvalidStateError:  # cancelled from the event loop since the check above
                pass
            except Exception as exc:  # a failed request fails alone, not the server
                log.exception("transcription failed")
                if not job.future.done():
                    job.future.set_exception(exc)
            finally:
                self._busy_since = None

    def _transcribe(self, job: _Job) -> Transcript:
        windows = self.features.windows(torch.from_numpy(job.samples))
        duration = len(job.samples) / self.sample_rate
        language = job.language
        seconds = self.features.chunk_seconds
        generator = torch.Generator().manual_seed(0) if job.temperature > 0 else None
        for first in range(0, len(windows), self.max_batch_windows):
            if job.future.cancelled():  # the client went away: decode nothing more for it
                break
            batch = windows[first : first + self.max_batch_windows]
            tokens, languages = decode_windows(
                self.model,
                self.features(batch),
                self.prompt,
                job.task,
                language,
                previous=job.previous,
                temperature=job.temperature,
                generator=generator,
            )
            language = language or languages[0]  # the first window's language holds for the rest
            for i, ids in enumerate(tokens):
                start = (first + i) * seconds
                seg = Segment(start, min(start + seconds, duration), ids, self.detokenize(ids))
                job.segments.append(seg)
                if job.on_window is not None:
                    job.on_window(seg)
        text = "".join(s.text for s in job.segments).strip()
        return Transcript(text, language, duration, job.segments)

    def stats(self) -> dict:
        return {"device": self.device, "num_waiting_requests": self._jobs.qsize(), "num_transcribed": self._transcribed}

    def shutdown(self) -> None:
        self._stopped = True
        self._jobs.put(None)
        self._thread.join(timeout=30)
