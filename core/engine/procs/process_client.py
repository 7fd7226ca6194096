"""``ProcessEngineClient``: the EngineClient of an engine running in its own process.

The server keeps only the tokenizer and a queue per live request; the engine process (see
:mod:`llmkit.core.engine.procs.worker`) owns the model, KV cache, grammar matchers and detokenizer. A
reader thread turns output frames into asyncio events. If the engine process dies, every waiting
client gets an error at once, ``/health`` fails, and the server is told to exit (SIGTERM to
itself, so it drains what is left and exits non-zero).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import zmq

from llmkit.core.engine.client import QueueSlots
from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.messages import GenerateRequest, RequestOutput, from_wire, to_wire
from llmkit.core.engine.procs import ipc
from llmkit.core.grammar.contract import GrammarError, GrammarSpec

log = logging.getLogger("llmkit")
_TOKENIZER_LOCK = threading.Lock()


class _EarlyTokenizer:
    """The server's tokenizer, loaded on a thread while the engine process starts."""

    def __init__(self, model_path: str | None) -> None:
        path = Path(model_path).expanduser() if model_path else None
        self.dir = path if path is not None and (path / "config.json").exists() else None
        self.tokenizer = None
        self.thread = threading.Thread(target=self._load, name="llmkit-tokenizer", daemon=True)
        self.thread.start()

    def _load(self) -> None:
        try:  # (None: only transformers imported)
            self.tokenizer = _load_tokenizer(self.dir)
        except Exception:  # loaded again after the engine is up, which says what is wrong with the model
            pass

    def result(self, model_dir: Path):
        self.thread.join()
        if self.tokenizer is not None and self.dir == Path(model_dir):
            return self.tokenizer
        return _load_tokenizer(model_dir)


def _load_tokenizer(model_dir: Path | None):
    with _TOKENIZER_LOCK:  # transformers' lazy imports are not thread-safe (--dp-size starts replicas at once)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir)) if model_dir is not None else None


def stop_server_soon() -> None:
    """Give the errors a moment to reach their clients, then stop the server (it exits non-zero)."""
    log.error("shutting the server down")
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()


class ProcessEngineClient(QueueSlots):
    def __init__(
        self,
        config: EngineConfig,
        max_queued: int,
        *,
        rank: int = 0,
        startup_timeout: float = 900.0,
        on_death: Callable[[ProcessEngineClient], None] | None = None,
    ) -> None:
        """``on_death``: called (on the reader thread) once the engine process is gone and its
        clients have their errors; by default the server is stopped (a data-parallel server
        restarts the replica instead)."""
        super().__init__(max_queued)
        self.rank = rank  # the data-parallel replica this engine is (0 without --dp-size)
        self.on_death = on_death
        self.dead: str | None = None  # why the engine process is gone
        self._fatal: str | None = None  # the reason the engine sent before exiting, if it could
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._calls: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._stats: dict[str, Any] = {}
        self._stats_at = time.monotonic()
        self._send_lock = threading.Lock()
        self._closed = False
        self._ipc_dir = tempfile.mkdtemp(prefix="llmkit-ipc-")
        os.chmod(self._ipc_dir, 0o700)  # the sockets are reachable by this user only
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PULL)
        self._in.bind(ipc.outbox_address(self._ipc_dir))
        self._out = self._ctx.socket(zmq.PUSH)
        self._out.connect(ipc.inbox_address(self._ipc_dir))
        cmd = [
            sys.executable,
            "-m",
            "llmkit.core.engine.procs.worker",
            json.dumps(dataclasses.asdict(config)),
            self._ipc_dir,
            str(rank),
        ]
        self.proc = subprocess.Popen(cmd)
        # The tokenizer (~1.5 s, most of it transformers' imports) loads on this process's core
        # while the engine process starts on the other, not after it: where the model directory
        # is known before the engine resolves it (a directory, not a GGUF), the tokenizer itself.
        early = _EarlyTokenizer(config.model_path)
        try:
            ready = self._wait_ready(startup_timeout)
        except BaseException:
            self._kill()
            raise

        self.model_dir = Path(ready["model_dir"])
        self.max_context = int(ready["max_context"])
        self.vocab_size = int(ready["vocab_size"])
        self.engine_pid = int(ready["pid"])
        self._stats, self._stats_at = ready.get("stats", {}), time.monotonic()
        self.tokenizer = early.result(self.model_dir)
        self._reader = threading.Thread(target=self._read, name="llmkit-engine-reader", daemon=True)
        self._reader.start()
        log.info("Engine process started (pid %d, rank %d)", self.engine_pid, rank)

    def _wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._in.poll(500):
                kind, payload = ipc.unpack(self._in.recv())
                if kind == "ready":
                    return payload
                if kind in ("failed", "fatal"):
                    raise ValueError(payload["error"])
            elif self.proc.poll() is not None:
                raise RuntimeError(
                    f"the engine process (rank {self.rank}) exited with code {self.proc.returncode} while starting"
                )
        raise TimeoutError(f"the engine process was not ready after {timeout:.0f} s")

    # -- EngineClient ------------------------------------------------------------------------------
    async def _call(self, kind: str, payload: dict, timeout: float = 30) -> dict | None:
        """Send ``kind`` and wait for the engine's ``reply`` to it: its error, or None."""
        loop = asyncio.get_running_loop()
        call_id = uuid.uuid4().hex
        fut = loop.create_future()
        self._calls[call_id] = (loop, fut)
        try:
            self._send(kind, {"id": call_id, **payload})
            return await asyncio.wait_for(fut, timeout=timeout)
        finally:
            self._calls.pop(call_id, None)

    async def _lora_call(self, op: str, name: str, path: str | None = None) -> None:
        error = await self._call("lora", {"op": op, "name": name, "path": path}, timeout=300)
        if error is not None:  # the engine process's exception, by its type's name
            raise (KeyError if error["param"] == "KeyError" else ValueError)(error["message"])

    async def load_lora_adapter(self, name: str, path: str) -> None:
        await self._lora_call("load", name, path)

    async def unload_lora_adapter(self, name: str) -> None:
        await self._lora_call("unload", name)

    async def check_grammar(self, spec: GrammarSpec) -> None:
        error = await self._call("grammar", {"spec": to_wire(spec)})
        if error is not None:
            raise GrammarError(error["param"], error["message"])

    async def flush_cache(self) -> bool:
        return await self._call("flush", {}) is None

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[req.rid] = (loop, q)
        finished = False
        try:
            if self.dead is not None:
                q.put_nowait(self._death_output(req.rid))
            else:
                self._send("add", to_wire(req))
            while True:
                out = await q.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(req.rid, None)
            if not finished and self.dead is None:
                self._send("abort", {"rid": req.rid})

    async def abort(self, rid: str) -> None:
        self._send("abort", {"rid": rid})

    def alive(self) -> bool:
        return self.dead is None and self.proc.poll() is None

    def stats(self) -> dict:
        return dict(self._stats)

    def degraded(self) -> str | None:
        return None

    def progress_age(self) -> float:
        # the age the engine reported, plus how long ago it did: a frozen process reports nothing
        if not self._stats:
            return 0.0  # no report yet: loading
        return self._stats.get("last_step_age_s", 0.0) + time.monotonic() - self._stats_at

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.proc.poll() is None:
            self._send("shutdown")
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._kill()

    # -- internals ---------------------------------------------------------------------------------
    def _send(self, kind: str, payload: Any = None) -> None:
        with self._send_lock:  # the event loop and the shutdown thread both send
            self._out.send(ipc.pack(kind, payload))

    def _read(self) -> None:
        while not self._closed:
            try:
                if not self._in.poll(200):
                    if self.proc.poll() is not None and not self._closed:
                        return self._on_engine_death()
                    continue
                kind, payload = ipc.unpack(self._in.recv())
            except zmq.ZMQError:
                return  # closed by shutdown
            if kind == "out":
                entry = self._streams.get(payload["rid"])
                if entry is not None:
                    entry[0].call_soon_threadsafe(entry[1].put_nowait, from_wire(RequestOutput, payload))
            elif kind == "reply":
                entry = self._calls.get(payload["id"])
                if entry is not None:
                    loop, fut = entry
                    loop.call_soon_threadsafe(lambda f=fut, e=payload["error"]: f.done() or f.set_result(e))
            elif kind == "stats":
                self._stats, self._stats_at = payload, time.monotonic()
            elif kind == "fatal":
                self._fatal = payload["error"]

    def _death_output(self, rid: str) -> RequestOutput:
        return RequestOutput(rid=rid, finished=True, finish_reason="abort", error=self.dead)

    def _on_engine_death(self) -> None:
        code = self.proc.returncode
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        self.dead = f"the engine process (rank {self.rank}, pid {self.proc.pid}) died: {how}"
        if self._fatal:
            self.dead += f" ({self._fatal})"
        log.error("%s; failing %d in-flight request(s)", self.dead, len(self._streams))
        for rid, (loop, q) in list(self._streams.items()):
            loop.call_soon_threadsafe(q.put_nowait, self._death_output(rid))
        for loop, fut in list(self._calls.values()):
            loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_exception(RuntimeError(self.dead)))
        if self.on_death is not None:
            self.on_death(self)
        else:
            stop_server_soon()

    def discard(self) -> None:
        """Free what is left of a dead engine (its sockets and their folder)."""
        self._closed = True
        self._kill()

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
