"""A small pool of killable compiler subprocesses (see compile_worker.py for the protocol).

Each job gets a whole worker; a job past its deadline kills its worker and a fresh one is started
in its place, so a hostile grammar costs one deadline of one core and the other workers keep
compiling. Worker start-up (importing xgrammar, ~2-3 s) does not count against a job's deadline.
"""

from __future__ import annotations

import json
import os
import queue
import selectors
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

WORKER_SCRIPT = Path(__file__).with_name("compile_worker.py")


class WorkerTimeout(Exception):
    """The job ran past its deadline; the worker was killed."""


class WorkerCrashed(Exception):
    """The worker died (crash, OOM kill) while running a job."""


class _Worker:
    def __init__(self, init: bytes):
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            bufsize=0,
        )
        self.ready = False
        self._buffer = b""
        # The init frame (~1.6 MB of vocabulary) fills the pipe; write it without blocking the caller.
        self._init_writer = threading.Thread(target=self._write, args=(init,), daemon=True)
        self._init_writer.start()

    def _write(self, data: bytes) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(data)
        except (BrokenPipeError, OSError, ValueError):
            pass  # noticed as end of output when reading

    def _read_frame(self, deadline: float) -> dict:
        while True:
            if len(self._buffer) >= 4:
                (size,) = struct.unpack(">I", self._buffer[:4])
                if len(self._buffer) >= 4 + size:
                    body, self._buffer = self._buffer[4 : 4 + size], self._buffer[4 + size :]
                    return json.loads(body)
            remaining = max(0.0, deadline - time.monotonic())
            assert self.proc.stdout is not None
            with selectors.DefaultSelector() as sel:
                sel.register(self.proc.stdout, selectors.EVENT_READ)
                if not sel.select(remaining):
                    raise WorkerTimeout
            chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
            if not chunk:
                raise WorkerCrashed
            self._buffer += chunk

    def wait_ready(self, timeout: float) -> None:
        if self.ready:
            return
        self._init_writer.join(timeout)
        reply = self._read_frame(time.monotonic() + timeout)
        if not reply.get("ready"):
            raise WorkerCrashed
        self.ready = True

    def poll_ready(self) -> bool:
        """Whether the worker has started, without waiting (a failed start counts as ready:
        :meth:`wait_ready` reports it)."""
        if self.ready or self.proc.poll() is not None:
            return True
        if self._init_writer.is_alive():
            return False
        try:
            self.wait_ready(0.0)
        except WorkerTimeout:
            return False
        except WorkerCrashed:
            return True
        return True

    def request(self, job: dict, timeout: float) -> dict:
        body = json.dumps(job).encode()
        deadline = time.monotonic() + timeout
        self._write(struct.pack(">I", len(body)) + body)
        return self._read_frame(deadline)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - the kernel will reap it
            pass


class CompileWorkerPool:
    """Up to ``size`` compiler subprocesses; :meth:`run` borrows one per job.

    Workers start on demand (or all at once in :meth:`wait_ready`): each imports xgrammar and
    with it torch (~260 MB resident), which a server that never sees a constrained request
    should not carry."""

    def __init__(self, init: dict, size: int = 2, startup_timeout: float = 120.0):
        body = json.dumps(init).encode()
        self._init = struct.pack(">I", len(body)) + body
        self._startup_timeout = startup_timeout
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._closed = False
        self._restarts = 0
        self._size = max(1, size)
        self._started = 0
        self._lock = threading.Lock()

    def _start_missing(self, at_most: int) -> None:
        with self._lock:
            while self._started < self._size and at_most > 0:
                self._idle.put(_Worker(self._init))
                self._started += 1
                at_most -= 1

    @property
    def restarts(self) -> int:
        """How many workers were killed and replaced (deadlines and crashes)."""
        return self._restarts

    def run(self, job: dict, timeout: float) -> dict:
        """Run ``job`` on an idle worker within ``timeout`` seconds of compile time.

        Raises WorkerTimeout or WorkerCrashed (the worker is replaced), or RuntimeError when a
        worker cannot start at all (a server problem, not the client's).
        """
        if self._closed:
            raise RuntimeError("the grammar compiler pool is closed")
        worker = self._take()
        if worker.ready and worker.proc.poll() is not None:
            worker = self._replace(worker)  # died while idle (killed from outside): not this job's fault
        try:
            try:
                worker.wait_ready(self._startup_timeout)
            except (WorkerTimeout, WorkerCrashed):
                worker = self._replace(worker)
                raise RuntimeError("the grammar compiler worker failed to start (see its stderr)") from None
            try:
                return worker.request(job, timeout)
            except (WorkerTimeout, WorkerCrashed):
                worker = self._replace(worker)
                raise
        finally:
            if self._closed:
                worker.kill()
            else:
                self._idle.put(worker)

    def _take(self) -> _Worker:
        if self._idle.empty():
            self._start_missing(1)
        worker = self._idle.get()
        if worker.poll_ready():
            return worker
        # A freshly replaced worker is still importing xgrammar: prefer one that is ready.
        try:
            other = self._idle.get_nowait()
        except queue.Empty:
            return worker
        if other.poll_ready():
            self._idle.put(worker)
            return other
        self._idle.put(other)
        return worker

    def wait_ready(self, timeout: float | None = None) -> None:
        """Start every worker and block until the idle ones are ready."""
        self._start_missing(self._size)
        workers = []
        while True:
            try:
                workers.append(self._idle.get_nowait())
            except queue.Empty:
                break
        try:
            for worker in workers:
                try:
                    worker.wait_ready(self._startup_timeout if timeout is None else timeout)
                except (WorkerTimeout, WorkerCrashed):
                    pass  # reported (and replaced) by the next run() that gets it
        finally:
            for worker in workers:
                self._idle.put(worker)

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        self._restarts += 1
        return _Worker(self._init)

    def close(self) -> None:
        """Kill every idle worker; busy ones are killed when their job returns."""
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                break
