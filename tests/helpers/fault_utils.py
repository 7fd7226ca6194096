"""Helpers for the fault tests: streaming clients that record how they ended, and small batches."""

from __future__ import annotations

import io
import json
import time

import httpx


def stream_lines(url: str, body: dict, out: dict, timeout: float = 90) -> None:
    """POST a streaming request; record the status, the SSE lines and any exception in ``out``."""
    out["lines"] = lines = []
    try:
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=timeout) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line:
                    lines.append(line)
    except Exception as exc:  # noqa: BLE001 - how the stream ended is what the tests check
        out["exc"] = repr(exc)


def post_json(url: str, body: dict, out: dict, timeout: float = 90) -> None:
    try:
        r = httpx.post(url, json=body, timeout=timeout)
        out["status"], out["body"] = r.status_code, r.json()
    except Exception as exc:  # noqa: BLE001
        out["exc"] = repr(exc)


def submit_batch(client, n: int, max_tokens: int = 4):
    """A chat batch of ``n`` lines, custom_ids ``line-0`` ..."""
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "m",
                "max_tokens": max_tokens,
                "temperature": 0,
                "messages": [{"role": "user", "content": f"Count to {i}."}],
            },
        }
        for i in range(n)
    ]
    data = "\n".join(json.dumps(x) for x in lines).encode() + b"\n"
    f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")


def wait_batch(client, batch_id: str, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "cancelled", "expired"):
            return b
        time.sleep(0.3)
    raise AssertionError(f"batch {batch_id} did not finish within {timeout} s")


def output_ids(client, batch) -> list[str]:
    text = client.files.content(batch.output_file_id).text
    return [json.loads(x)["custom_id"] for x in text.splitlines() if x.strip()]


class LongStreams:
    """``n`` long streaming completions on threads, each line kept, to kill something under."""

    def __init__(self, url: str, n: int) -> None:
        import threading

        self.events: list[list[str]] = [[] for _ in range(n)]
        self.started = threading.Event()
        self.threads = [
            threading.Thread(target=self._stream, args=(url, ev, i), daemon=True) for i, ev in enumerate(self.events)
        ]
        for t in self.threads:
            t.start()

    def _stream(self, url: str, events: list[str], i: int) -> None:
        body = {"model": "m", "prompt": [5, 6, i + 7], "max_tokens": 240, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json=body) as r:
            for line in r.iter_lines():
                self.started.set()
                events.append(line)

    def join_all(self, since: float, within: float = 10.0) -> None:
        """Wait until ``within`` seconds after ``since``; fail if a client is still waiting."""
        for t in self.threads:
            t.join(max(0.1, within - (time.monotonic() - since)))
        assert not any(t.is_alive() for t in self.threads), "a client was left waiting"
