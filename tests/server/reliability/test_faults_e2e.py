"""Faults on a real ``llmkit serve``, bounded for CI: kill -9 during a stream and during a batch,
SIGTERM under load. Each ends with nothing lost (a batch line written exactly once, every client
answered or told it failed) and no client waiting for ever."""

from __future__ import annotations

import json
import signal
import threading
import time

import openai

from fault_utils import output_ids, post_json, stream_lines, submit_batch, wait_batch
from server_utils import kill_server, server_log, start_server, stop_server

LONG = {"model": "m", "prompt": "Once upon a time", "max_tokens": 6000, "ignore_eos": True}


def test_kill9_mid_stream_ends_the_client():
    proc, url = start_server(["--batch-storage", "none"])
    out: dict = {}
    t = threading.Thread(target=stream_lines, args=(url + "/v1/completions", LONG, out))
    try:
        t.start()
        deadline = time.monotonic() + 60
        while len(out.get("lines", ())) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        kill_server(proc)
        t.join(15)
        assert not t.is_alive(), "the client is still waiting after kill -9"
        # It knows the stream broke: an error, or at least no [DONE] (never a clean-looking end).
        assert "exc" in out or out["lines"][-1] != "data: [DONE]", out
    finally:
        kill_server(proc)


def test_kill9_mid_batch_resumes_each_line_once(tmp_path):
    # The restarted server is a new lease holder: it resumes the batch once the killed server's
    # lease expires (a short one here; the default 30 s would idle most of the test).
    args = ["--batch-storage", "local", "--file-storage-path", str(tmp_path / "store"), "--batch-lease-ttl", "3"]
    proc, url = start_server(args)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        batch = submit_batch(client, 24)
        deadline = time.monotonic() + 120
        while client.batches.retrieve(batch.id).request_counts.completed < 4:
            assert time.monotonic() < deadline, server_log(proc)
            time.sleep(0.1)
    finally:
        kill_server(proc)
    proc, url = start_server(args)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        done = wait_batch(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 24, done
        assert sorted(output_ids(client, done)) == sorted(f"line-{i}" for i in range(24))
    finally:
        stop_server(proc)


def test_sigterm_under_load_answers_every_client():
    proc, url = start_server(["--batch-storage", "none", "--shutdown-timeout", "4"])
    outs = [{} for _ in range(12)]
    threads = []
    for i, out in enumerate(outs):
        short = {"model": "m", "prompt": f"Story {i}:", "max_tokens": 8}
        body = LONG if i % 3 == 0 else short
        target = stream_lines if i % 2 else post_json
        threads.append(threading.Thread(target=target, args=(url + "/v1/completions", body, out)))
    try:
        for t in threads:
            t.start()
        time.sleep(2.0)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a client is still waiting"
        for out in outs:
            assert "exc" not in out, (out, server_log(proc))
            if "lines" in out:  # streams end with [DONE], after content or a final error event
                assert out["status"] == 200 and out["lines"][-1] == "data: [DONE]", out
                last = json.loads(out["lines"][-2][6:])
                assert "error" in last or last["choices"][0]["finish_reason"] == "length", last
            else:  # finished (200), or answered 503 in OpenAI's shape
                assert out["status"] in (200, 503), out
                if out["status"] == 503:
                    assert out["body"]["error"]["code"] == "server_shutting_down"
        assert proc.wait(30) == 0
    finally:
        stop_server(proc)
