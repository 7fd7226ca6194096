"""The ``redis`` KV storage backend: entries as Redis strings (Valkey speaks the same protocol).

A small RESP client over one socket per thread (the tier reads and writes from two threads), so
no client package is needed. Settings (``--hicache-storage-backend-extra-config``): ``url``
(``redis://[:password@]host:port[/db]``, default ``redis://127.0.0.1:6379/0``), ``key_prefix``
(default ``llmkit:kv:``), ``timeout`` (seconds a connect or a command may take, default 2) and
``ttl_s`` (entries expire after this many seconds; default none: set ``maxmemory-policy
allkeys-lru`` on the server to bound it).
"""

from __future__ import annotations

import socket
import threading
from urllib.parse import unquote, urlparse

from llmkit.core.kvcache.kv_storage import KVStorage


class RedisError(RuntimeError):
    """An error reply from the server."""


class RedisKVStorage(KVStorage):
    def __init__(
        self,
        *,
        path: str | None = None,
        url: str = "redis://127.0.0.1:6379/0",
        key_prefix: str = "llmkit:kv:",
        timeout: float = 2.0,
        ttl_s: int | None = None,
    ) -> None:
        u = urlparse(url)
        if u.scheme not in ("redis", "valkey"):
            raise ValueError(f"a Redis url is redis://host:port[/db] (got {url!r})")
        self.address = (u.hostname or "127.0.0.1", u.port or 6379)
        self.password = unquote(u.password) if u.password else None
        self.db = int(u.path.strip("/") or 0)
        self.prefix = key_prefix.encode()
        self.timeout = float(timeout)
        self.ttl_s = ttl_s
        self._local = threading.local()

    # -- the protocol ------------------------------------------------------------------------
    def _conn(self):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            sock = socket.create_connection(self.address, timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = self._local.conn = (sock, sock.makefile("rb"))
            if self.password is not None:
                self._call(b"AUTH", self.password.encode())
            if self.db:
                self._call(b"SELECT", str(self.db).encode())
        return conn

    def _call(self, *args: bytes):
        sock, reader = self._conn()
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            out += [b"$%d\r\n" % len(a), a, b"\r\n"]
        try:
            sock.sendall(b"".join(out))
            return self._reply(reader)
        except RedisError:
            raise
        except BaseException:  # a broken or timed-out connection: the next call opens a new one
            self._drop()
            raise

    def _reply(self, reader):
        line = reader.readline()
        if not line.endswith(b"\r\n"):
            raise ConnectionError("the Redis connection closed")
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest
        if kind == b"-":
            raise RedisError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = reader.read(n + 2)
            if len(data) != n + 2:
                raise ConnectionError("the Redis connection closed mid-reply")
            return data[:-2]
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._reply(reader) for _ in range(n)]
        raise ConnectionError(f"not a Redis reply: {line[:20]!r}")

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn[1].close()
            conn[0].close()

    # -- KVStorage ---------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        return self._call(b"GET", self.prefix + key.encode())

    def put(self, key: str, data: bytes) -> None:
        args = [b"SET", self.prefix + key.encode(), data]
        if self.ttl_s:
            args += [b"EX", str(int(self.ttl_s)).encode()]
        self._call(*args)

    def exists(self, key: str) -> bool:
        return bool(self._call(b"EXISTS", self.prefix + key.encode()))

    def close(self) -> None:
        self._drop()
