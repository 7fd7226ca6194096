"""``--gateway-url``: the worker registers itself with SGLang's Model Gateway, and leaves it.

The gateway (sglang-router 0.3) adds and removes workers at run time through its control plane:

- ``POST /workers`` with ``{"url": ..., "api_key": ...}`` answers 202 and ``{"worker_id": ...}``;
  the gateway then checks the worker (``/health``, ``/server_info``, ``/v1/models``) in the
  background. ``api_key`` is the key the gateway sends to this worker: without it the worker's
  model is not discovered. A second POST of the same URL answers the same id.
- ``GET /workers`` lists ``{"workers": [{"id", "url", "is_healthy", ...}]}``.
- ``DELETE /workers/{worker_id}`` (a UUID; a URL is refused) answers 202.

A gateway started with ``--api-key`` asks that key of these routes too (``Authorization: Bearer``);
the worker sends its own ``--api-key``, the one a gateway in front of keyed workers is given.

All of it runs on a thread with the standard library: serving never waits on the gateway, and no
failure here stops the worker (a kill -9 is left to the gateway's health checks).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request

log = logging.getLogger("llmkit")

BACKOFF_S = (0.5, 10.0)  # first and longest wait between attempts while the gateway is not up
REQUEST_TIMEOUT_S = 5.0  # one HTTP call to the gateway
SELF_READY_S = 120.0  # how long to wait for this server's own /health before registering anyway
CONFIRM_S = 60.0  # how long to watch the gateway's check of this worker, only to log its outcome
# How often a registered worker checks that the gateway still lists it: a restarted gateway starts
# empty (it keeps no list), so its workers register again on their own.
RECHECK_S = float(os.environ.get("LLMKIT_GATEWAY_RECHECK_S", "30"))


def advertised_url(host: str, port: int, given: str | None = None) -> str:
    """The URL the gateway reaches this worker at: ``given`` (--gateway-worker-url), else
    http://host:port, with a wildcard host (0.0.0.0, ::) replaced by this machine's address as
    its host name resolves (behind NAT, or where that is a loopback address, give the URL)."""
    if given:
        return given.rstrip("/")
    if host in ("0.0.0.0", "::", ""):
        try:
            family = socket.AF_INET6 if host == "::" else socket.AF_INET
            host = socket.getaddrinfo(socket.gethostname(), None, family, socket.SOCK_STREAM)[0][4][0]
        except (OSError, IndexError):
            host = "127.0.0.1" if host != "::" else "::1"
        if ipaddress.ip_address(host).is_loopback:
            log.warning(
                "gateway: this machine's name resolves to %s; give --gateway-worker-url if the gateway runs elsewhere",
                host,
            )
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address in a URL
    return f"http://{host}:{port}"


def local_url(host: str, port: int) -> str:
    """Where this process reaches its own server (to wait until it listens)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _call(method: str, url: str, api_key: str | None, body: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body); status 0 when the gateway cannot be reached."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
            raw, status = resp.read(), resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    except (urllib.error.URLError, OSError) as exc:
        return 0, {"error": str(getattr(exc, "reason", exc))}
    try:
        parsed = json.loads(raw) if raw else {}
    except ValueError:
        parsed = {"error": raw[:200].decode(errors="replace")}
    return status, parsed if isinstance(parsed, dict) else {}


class GatewayRegistration:
    """Register ``worker_url`` with the gateway once this server answers ``/health``; deregister
    when it starts draining (the gateway then stops sending it new requests while in-flight ones
    finish) or, at the latest, when it stops."""

    def __init__(self, gateway_url: str, worker_url: str, self_url: str, api_key: str | None, draining=None):
        self.gateway = gateway_url.rstrip("/")
        self.worker_url = worker_url
        self.self_url = self_url
        self.api_key = api_key
        self.draining = draining or (lambda: False)  # the server's "SIGTERM came" flag
        self._stop = threading.Event()
        self._lock = threading.Lock()  # registering and deregistering never overlap
        self._posted = False  # the gateway may list us: deregister on the way out
        self._thread = threading.Thread(target=self._run, name="gateway-registration", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Deregister (a few bounded HTTP calls) and end the thread. Safe to call twice."""
        self._stop.set()
        self._thread.join(timeout=REQUEST_TIMEOUT_S + 1)
        self.deregister()

    def _run(self) -> None:
        try:
            self._wait_until_serving()
            if self._register():
                self._confirm()
                # Leave as soon as draining begins, not only once the server has stopped.
                next_check = time.monotonic() + RECHECK_S
                while not self._stop.wait(0.2):
                    if self.draining():
                        self.deregister()
                        return
                    if time.monotonic() >= next_check:
                        self._register_again_if_forgotten()
                        next_check = time.monotonic() + RECHECK_S
        except Exception:  # never let the gateway take the worker down
            log.exception("gateway: registration failed")

    def _wait_until_serving(self) -> None:
        """Until this server answers its own /health: the gateway checks the worker at once."""
        deadline = time.monotonic() + SELF_READY_S
        while time.monotonic() < deadline and not self._stop.is_set():
            if _call("GET", self.self_url + "/health", None)[0] == 200:
                return
            self._stop.wait(0.2)

    def _register(self) -> bool:
        """POST /workers until the gateway takes it; each distinct failure is logged once."""
        delay, seen = BACKOFF_S[0], set()
        body = {"url": self.worker_url, **({"api_key": self.api_key} if self.api_key else {})}
        while not self._stop.is_set() and not self.draining():
            with self._lock:
                self._posted = True  # it may land even if the answer is lost
                status, answer = _call("POST", self.gateway + "/workers", self.api_key, body)
            if 200 <= status < 300:
                log.info(
                    "gateway: registered %s with %s (id %s)", self.worker_url, self.gateway, answer.get("worker_id")
                )
                return True
            why = f"HTTP {status}: {answer.get('error') or answer}" if status else answer.get("error", "unreachable")
            if why not in seen:
                seen.add(why)
                log.warning(
                    "gateway: cannot register with %s (%s); retrying every %g s at most",
                    self.gateway,
                    why,
                    BACKOFF_S[1],
                )
            self._stop.wait(delay)
            delay = min(delay * 2, BACKOFF_S[1])
        return False

    def _confirm(self) -> None:
        """Log whether the gateway's own check of this worker passed (a wrong advertised URL shows here)."""
        waited, seen = 0.0, False
        while waited < CONFIRM_S and not self._stop.is_set() and not self.draining():
            listed = self._listed(answering_only=True)
            if listed is None:  # the gateway went away: the recheck registers again once it is back
                return
            # Not listed after it was, or still not after a recheck's time (a gateway adds a worker
            # within a second): it restarted, and the recheck registers again.
            if not listed and (seen or waited >= RECHECK_S):
                return
            seen = seen or bool(listed)
            if any(w.get("is_healthy") for w in listed):
                log.info("gateway: %s routes to this worker", self.gateway)
                return
            self._stop.wait(1.0)
            waited += 1.0
        if waited >= CONFIRM_S:
            log.warning(
                "gateway: %s does not list %s as healthy after %g s: can it reach that URL? (--gateway-worker-url)",
                self.gateway,
                self.worker_url,
                CONFIRM_S,
            )

    def _register_again_if_forgotten(self) -> None:
        """The gateway answers without this worker (it restarted): register again. A gateway
        that does not answer is left alone until it does."""
        listed = self._listed(answering_only=True)
        if listed is not None and not listed:
            log.warning("gateway: %s no longer lists this worker (restarted?); registering again", self.gateway)
            if self._register():
                self._confirm()

    def _listed(self, answering_only: bool = False) -> list[dict] | None:
        """The gateway's entries with our URL ([] when it does not answer, or None with
        ``answering_only``)."""
        status, answer = _call("GET", self.gateway + "/workers", self.api_key)
        workers = answer.get("workers") if status == 200 else None
        if workers is None and answering_only:
            return None
        return [w for w in workers or () if isinstance(w, dict) and w.get("url", "").rstrip("/") == self.worker_url]

    def deregister(self) -> None:
        """DELETE /workers/{id} for each entry with our URL (ids are looked up: the gateway gives
        a re-added worker a new one)."""
        with self._lock:
            if not self._posted:
                return
            self._posted = False
            listed = self._listed()
            if not listed:
                log.info(
                    "gateway: %s does not list %s (or does not answer): nothing to deregister",
                    self.gateway,
                    self.worker_url,
                )
            for worker in listed:
                status, answer = _call("DELETE", f"{self.gateway}/workers/{worker['id']}", self.api_key)
                if 200 <= status < 300 or status == 404:
                    log.info("gateway: deregistered %s from %s", self.worker_url, self.gateway)
                else:
                    log.warning("gateway: cannot deregister %s (HTTP %s: %s)", self.worker_url, status, answer)
