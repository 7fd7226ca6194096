"""Loopback image hosts for the media tests: a well-behaved one, one that drips, and redirects."""

from __future__ import annotations

import contextlib
import http.server
import threading
import time


class ImageHost:
    """An HTTP server on 127.0.0.1 serving ``body`` at:

    - ``/img.png``: at once; ``/drip.png``: one byte every ``drip_interval`` s (a slow-loris body);
      ``/big.png``: 5,000 bytes without a ``Content-Length``;
    - ``/same``: a redirect to ``/img.png``; ``/other``: to ``localhost`` (another host), same port;
      ``/port``: to ``other_port`` (``/img.png`` on another port of this host), set by the caller.

    ``hosts`` collects the ``Host`` header of every request."""

    def __init__(self, body: bytes, drip_interval: float = 0.5):
        self.body, self.drip_interval, self.hosts = body, drip_interval, []
        self.other_port: int | None = None
        host = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                host.hosts.append(self.headers.get("Host"))
                port = self.server.server_address[1]
                redirects = {
                    "/same": "/img.png",
                    "/other": f"http://localhost:{port}/img.png",
                    "/port": f"http://127.0.0.1:{host.other_port}/img.png",
                }
                if self.path in redirects:
                    self.send_response(302)
                    self.send_header("Location", redirects[self.path])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif self.path in ("/img.png", "/drip.png"):
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(host.body)))
                    self.end_headers()
                    if self.path == "/img.png":
                        self.wfile.write(host.body)
                        return
                    with contextlib.suppress(OSError):  # the client gave up
                        for i in range(len(host.body)):
                            self.wfile.write(host.body[i : i + 1])
                            self.wfile.flush()
                            time.sleep(host.drip_interval)
                elif self.path == "/big.png":  # no Content-Length: the cap holds while reading
                    self.send_response(200)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(b"\0" * 5000)
                else:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
