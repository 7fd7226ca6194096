"""The wire between the HTTP server and an engine process: msgpack over ZeroMQ unix sockets.

Every frame is ``{"k": kind, "p": payload}`` with a payload of plain data (the dicts of
:func:`llmkit.core.engine.messages.to_wire`); nothing is pickled. Sockets are ``ipc://`` paths in
a private temporary directory, never TCP.

Server -> engine (``engine-in``): ``add`` (a GenerateRequest), ``abort`` ({rid}), ``grammar``
({id, spec}), ``flush`` ({id}: drop the prefix cache), ``shutdown``. Engine -> server (``engine-out``): ``ready`` / ``failed`` once at
start-up, ``out`` (a RequestOutput), ``reply`` ({id, error}), ``stats`` (a snapshot, twice a second),
``fatal`` ({error}: why the engine is about to exit, e.g. a tensor-parallel rank died).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack

STATS_INTERVAL_S = 0.5


def inbox_address(ipc_dir: str | Path) -> str:
    return f"ipc://{Path(ipc_dir) / 'engine-in'}"


def outbox_address(ipc_dir: str | Path) -> str:
    return f"ipc://{Path(ipc_dir) / 'engine-out'}"


def pack(kind: str, payload: Any = None) -> bytes:
    return msgpack.packb({"k": kind, "p": payload}, use_bin_type=True)


def unpack(frame: bytes) -> tuple[str, Any]:
    msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    return msg["k"], msg["p"]
