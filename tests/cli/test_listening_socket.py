"""The socket ``llmkit serve`` binds before the model loads: connections accepted on it get
TCP_NODELAY from asyncio (as on a socket uvicorn binds itself), so a kept-alive connection's
response never waits on the client's delayed ACK (40 ms a request, measured before the fix)."""

from __future__ import annotations

import asyncio
import socket

from llmkit.cli.listen import bind_socket


def test_accepted_connections_have_nodelay():
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    seen: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport):
            accepted = transport.get_extra_info("socket")
            seen.append(accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def run():
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(run())
    assert seen and seen[0] != 0
