"""The listening socket, bound before the model loads: a port in use fails at once instead of
after a load of seconds to minutes (uvicorn serves on the socket later)."""

from __future__ import annotations

import socket

from llmkit.core.option import OptionError


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket now, before the model loads (uvicorn serves on it later)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OptionError(
            f"--host '{host}' cannot be resolved ({exc.strerror}): give an IP address or a host name of this machine"
        ) from None
    family, _, _, _, addr = infos[0]
    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY on the accepted connections only when the
    # socket says it is TCP. Without it a kept-alive connection's response waited 40 ms for the
    # client's delayed ACK (Nagle), on every request after a connection's first.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        hint = (
            "another process is listening there: stop it or choose another --port"
            if exc.errno == 98
            else "choose another --host or --port"
        )
        raise OptionError(f"cannot listen on {host}:{port}: {exc.strerror}; {hint}") from None
    sock.set_inheritable(True)
    return sock
