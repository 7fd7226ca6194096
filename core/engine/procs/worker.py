"""The engine in its own process (``llmkit serve --engine-process``).

``python -m llmkit.core.engine.procs.worker CONFIG_JSON IPC_DIR [RANK]``: builds the engine from the
EngineConfig given as JSON, runs it on its thread exactly as in-process, and speaks the frames of
:mod:`llmkit.core.engine.procs.ipc`. ZeroMQ sockets are single-threaded, so each thread that sends owns
one: the engine thread sends outputs, this thread sends replies, a small thread sends stats.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import zmq

from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.messages import GenerateRequest, from_wire, to_wire
from llmkit.core.engine.procs import ipc
from llmkit.core.engine.stages.startup_gc import freeze_after_startup
from llmkit.core.grammar.contract import GrammarError, GrammarSpec

log = logging.getLogger("llmkit")
COMPILE_TIMEOUT_S = 5.0


def main(argv: list[str]) -> int:
    config = EngineConfig(**json.loads(argv[0]))
    ipc_dir = argv[1]
    rank = int(argv[2]) if len(argv) > 2 else 0  # the data-parallel replica, for the log lines
    tp_tag = " tp 0" if config.tp_size > 1 else ""
    logging.basicConfig(
        level=logging.INFO,
        format=f"[%(asctime)s engine rank {rank}{tp_tag}] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
    )
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(ipc.inbox_address(ipc_dir))

    def push() -> zmq.Socket:
        sock = ctx.socket(zmq.PUSH)
        sock.connect(ipc.outbox_address(ipc_dir))
        return sock

    ctl, out, stats_sock = push(), push(), push()
    followers = None
    try:
        from llmkit.core.engine.builder import build_engine_parts
        from llmkit.core.engine.loop import Engine

        tp = None
        if config.tp_size > 1:
            from llmkit.core.engine.procs.tp_launch import Followers

            config, followers = Followers.start(config, ipc.outbox_address(ipc_dir))
            tp = followers.join_group()

        def build():
            parts = build_engine_parts(config, tp=tp)
            if followers is not None:
                from llmkit.core.engine.procs.tp import bound_collectives

                parts.runner.broadcaster.on_fatal = followers.step_failed
                bound_collectives(tp)
            return parts

        # built on the engine thread, which runs it: one OpenMP team (see Engine.build_and_start)
        engine, parts = Engine.build_and_start(config, build)
        freeze_after_startup()
    except Exception as exc:  # the server prints it as its own start-up error
        ctl.send(ipc.pack("failed", {"error": f"{type(exc).__name__}: {exc}"}))
        ctl.close(linger=2000)
        if followers is not None:
            followers.kill()
        return 2
    tp_info = {}
    if followers is not None:  # the ranks of this node (others report on their own node)
        tp_info = {
            "tp_size": config.tp_size,
            "tp_ranks": [{"rank": 0, "pid": os.getpid()}]
            + [{"rank": r, "pid": p.pid} for r, p in sorted(followers.procs.items())],
        }

    def snapshot() -> dict:
        return {**engine.stats(), "engine_pid": os.getpid(), **tp_info}

    ctl.send(
        ipc.pack(
            "ready",
            {
                "max_context": parts.max_context,
                "vocab_size": parts.vocab_size,
                "model_dir": str(parts.model_dir),
                "pid": os.getpid(),
                "stats": snapshot(),  # the first stats: /get_server_info has them from the start
            },
        )
    )
    stop = threading.Event()

    def publish_stats() -> None:
        while not stop.wait(ipc.STATS_INTERVAL_S):
            stats_sock.send(ipc.pack("stats", snapshot()))

    threading.Thread(target=publish_stats, name="llmkit-engine-stats", daemon=True).start()
    ctl_lock = threading.Lock()
    compiles = ThreadPoolExecutor(2, thread_name_prefix="llmkit-grammar")

    def reply(call_id: str, error: dict | None) -> None:
        with ctl_lock:
            ctl.send(ipc.pack("reply", {"id": call_id, "error": error}))

    def check_grammar(call_id: str, spec: GrammarSpec) -> None:
        try:
            engine.grammar.compile(spec, timeout=COMPILE_TIMEOUT_S)
            reply(call_id, None)
        except GrammarError as exc:
            reply(call_id, {"param": exc.param, "message": exc.message})
        except Exception as exc:
            reply(call_id, {"param": spec.param, "message": f"grammar compilation failed: {exc}"})

    def lora_call(call_id: str, op: str, name: str, path: str | None) -> None:
        from llmkit.core.engine.client import lora_manager

        fn = (
            (lambda: lora_manager(engine).load(name, path))
            if op == "load"
            else (lambda: lora_manager(engine).unload(name))
        )

        def done(fut) -> None:
            exc = fut.exception()
            reply(call_id, None if exc is None else {"param": type(exc).__name__, "message": str(exc)})

        engine.call(fn).add_done_callback(done)

    def sink(output) -> None:  # called on the engine thread only
        out.send(ipc.pack("out", to_wire(output)))

    parent = os.getppid()
    code = 0
    while True:
        if not inbox.poll(500):
            if not engine.is_alive():
                log.error("the engine thread stopped; exiting")
                code = 1
                break
            if os.getppid() != parent:  # the server is gone: nobody to serve
                break
            continue
        kind, payload = ipc.unpack(inbox.recv())
        if kind == "add":
            engine.submit(from_wire(GenerateRequest, payload), sink)
        elif kind == "abort":
            engine.abort(payload["rid"])
        elif kind == "grammar":
            compiles.submit(check_grammar, payload["id"], GrammarSpec(**payload["spec"]))
        elif kind == "lora":
            lora_call(payload["id"], payload["op"], payload["name"], payload.get("path"))
        elif kind == "flush":
            engine.flush_cache(
                lambda ok, i=payload["id"]: reply(i, None if ok else {"message": "requests are running"})
            )
        elif kind == "shutdown":
            break
    stop.set()
    if followers is not None:
        followers.stopping = True  # their exit from here on is the normal one
    engine.shutdown()
    if followers is not None:
        followers.wait()
    compiles.shutdown(wait=False, cancel_futures=True)
    ctx.destroy(linger=1000)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
