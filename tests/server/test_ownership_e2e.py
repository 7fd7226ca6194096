"""Who may see what, end to end: a real ``llmkit serve`` with a keys file (two plain keys, an
admin, a rate-limited key), local storage, the official openai client. Another key's files,
batches and stored responses are the 404 of an unknown id on every route, lists hold only the
caller's objects, admins see everything, ownership survives a restart, and no key reaches the log."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from llmkit.core.batches.storage import FileRecord, new_file_id
from llmkit.plugins.storage.local import LocalStorage

from server_utils import start_server, stop_server

pytestmark = pytest.mark.slow

KEYS = {"alice": "sk-alice-5f1e2d", "bob": "sk-bob-77c0a1", "ops": "sk-ops-c3d9e8", "limited": "sk-lim-0b4f6a"}
KEYS_FILE = f"""# test keys
{KEYS["alice"]} alice
{KEYS["bob"]}   bob     # a plain key
{KEYS["ops"]} ops admin
{KEYS["limited"]} limited rpm=2
"""
WRONG_KEY = "sk-alice-5f1e2e"
UNKNOWN_FILE, UNKNOWN_BATCH, UNKNOWN_RESP = "file-" + "0" * 32, "batch_" + "0" * 32, "resp_" + "0" * 32


class Srv:
    def __init__(self, root) -> None:
        self.keys_file = root / "keys"
        self.keys_file.write_text(KEYS_FILE)
        self.storage = str(root / "storage")
        self.logs: list[str] = []
        self.start()

    def start(self) -> None:
        args = ["--api-keys-file", str(self.keys_file), "--file-storage-path", self.storage]
        self.proc, self.url = start_server([*args, "--context-length", "1024"])
        self.logs.append(self.proc.log_path)

    def client(self, who: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEYS[who], max_retries=0, timeout=120)

    def raw(self, who: str, method: str, path: str, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEYS[who]}"}
        return httpx.request(method, self.url + path, headers=headers, timeout=120, **kw)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = Srv(tmp_path_factory.mktemp("ownership"))
    try:
        yield s
    finally:
        stop_server(s.proc)


def _not_found(srv, who, method, path, unknown_path, **kw):
    """``who`` gets for ``path`` exactly the 404 of an id that does not exist (ids in messages aside)."""
    theirs, unknown = srv.raw(who, method, path, **kw), srv.raw(who, method, unknown_path, **kw)
    assert theirs.status_code == unknown.status_code == 404, (path, theirs.text)
    id_of = lambda p: p.split("/")[3]  # noqa: E731 - /v1/<kind>/<id>...
    assert theirs.text.replace(id_of(path), "ID") == unknown.text.replace(id_of(unknown_path), "ID")


def _upload(client, text: bytes = b'{"x": 1}\n'):
    return client.files.create(file=("in.jsonl", text), purpose="batch")


def _batch_input(n: int = 1) -> bytes:
    lines = [
        {
            "custom_id": f"r-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": f"Say {i}."}], "max_tokens": 2},
        }
        for i in range(n)
    ]
    return ("\n".join(json.dumps(x) for x in lines) + "\n").encode()


def test_files_are_the_uploaders(srv):
    alice, bob, ops = srv.client("alice"), srv.client("bob"), srv.client("ops")
    fa, fb = _upload(alice), _upload(bob)
    assert {f.id for f in alice.files.list()} & {fa.id, fb.id} == {fa.id}
    assert {f.id for f in bob.files.list()} & {fa.id, fb.id} == {fb.id}
    assert {fa.id, fb.id} <= {f.id for f in ops.files.list()}
    for method, suffix in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
        _not_found(srv, "bob", method, f"/v1/files/{fa.id}{suffix}", f"/v1/files/{UNKNOWN_FILE}{suffix}")
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(fa.id)
    assert alice.files.content(fa.id).read() == b'{"x": 1}\n'  # bob's delete did nothing
    assert ops.files.retrieve(fa.id).id == fa.id and ops.files.content(fb.id).read() == b'{"x": 1}\n'
    assert ops.files.delete(fb.id).deleted
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(fb.id)


def test_batches_are_their_creators_and_so_are_their_results(srv):
    alice, bob, ops = srv.client("alice"), srv.client("bob"), srv.client("ops")
    fa = _upload(alice, _batch_input(2))
    with pytest.raises(openai.NotFoundError) as exc:  # bob's batch may not read alice's file
        bob.batches.create(input_file_id=fa.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert exc.value.body["param"] == "input_file_id"
    ba = alice.batches.create(input_file_id=fa.id, endpoint="/v1/chat/completions", completion_window="24h")
    _not_found(srv, "bob", "POST", f"/v1/batches/{ba.id}/cancel", f"/v1/batches/{UNKNOWN_BATCH}/cancel")
    _not_found(srv, "bob", "GET", f"/v1/batches/{ba.id}", f"/v1/batches/{UNKNOWN_BATCH}")
    assert ba.id not in {b.id for b in bob.batches.list()}
    assert ba.id in {b.id for b in alice.batches.list()} and ba.id in {b.id for b in ops.batches.list()}
    deadline = time.time() + 300
    while (done := alice.batches.retrieve(ba.id)).status not in ("completed", "failed", "cancelled"):
        assert time.time() < deadline
        time.sleep(0.3)
    assert done.status == "completed"  # bob's cancel did not reach it
    assert len(alice.files.content(done.output_file_id).read().splitlines()) == 2
    _not_found(srv, "bob", "GET", f"/v1/files/{done.output_file_id}/content", f"/v1/files/{UNKNOWN_FILE}/content")
    assert done.output_file_id not in {f.id for f in bob.files.list()}
    assert ops.batches.retrieve(ba.id).status == "completed"
    # the owner cancels her own; an admin cancels anyone's
    for who in ("alice", "ops"):
        b = alice.batches.create(input_file_id=fa.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert srv.client(who).batches.cancel(b.id).id == b.id


def test_stored_responses_are_their_creators(srv):
    alice, bob, ops = srv.client("alice"), srv.client("bob"), srv.client("ops")
    ra = alice.responses.create(model="m", input="Hi", max_output_tokens=4, store=True)
    for method, suffix in (("GET", ""), ("GET", "/input_items"), ("DELETE", ""), ("POST", "/cancel")):
        _not_found(srv, "bob", method, f"/v1/responses/{ra.id}{suffix}", f"/v1/responses/{UNKNOWN_RESP}{suffix}")
    with pytest.raises(openai.NotFoundError) as exc:
        bob.responses.create(model="m", input="Go on", max_output_tokens=4, previous_response_id=ra.id)
    assert exc.value.body["param"] == "previous_response_id"
    background = alice.responses.create(model="m", input="Count to 50", max_output_tokens=64, background=True)
    with pytest.raises(openai.NotFoundError):
        bob.responses.cancel(background.id)
    assert alice.responses.cancel(background.id).status in ("cancelled", "completed", "incomplete")
    # the owner and an admin read and continue it; bob's delete did not delete it
    assert alice.responses.retrieve(ra.id).id == ra.id
    assert alice.responses.input_items.list(ra.id).data
    assert alice.responses.create(model="m", input="Go on", max_output_tokens=4, previous_response_id=ra.id).id
    assert ops.responses.retrieve(ra.id).id == ra.id
    assert ops.responses.create(model="m", input="Go on", max_output_tokens=4, previous_response_id=ra.id).id
    assert ops.responses.delete(ra.id) is None
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(ra.id)


def test_a_key_over_its_rate_gets_429_with_retry_after(srv):
    limited = srv.client("limited")
    limited.models.list()
    limited.models.list()
    with pytest.raises(openai.RateLimitError) as exc:
        limited.models.list()
    assert int(exc.value.response.headers["Retry-After"]) >= 1
    assert exc.value.body["type"] == "rate_limit_error"
    srv.client("alice").models.list()  # other keys are not limited by it


def test_ownership_survives_a_restart(srv):
    alice = srv.client("alice")
    fa = _upload(alice)
    ra = alice.responses.create(model="m", input="Hi", max_output_tokens=4, store=True)
    stop_server(srv.proc)
    # a file stored before files had owners: for admins only
    storage = LocalStorage(srv.storage)
    legacy = FileRecord(new_file_id(), 9, int(time.time()), "old.jsonl", "batch")
    storage.write_blob(legacy.id, [b'{"x": 1}\n'])
    storage.put_file(legacy)
    storage.close()
    srv.start()
    alice, ops = srv.client("alice"), srv.client("ops")
    assert alice.files.retrieve(fa.id).id == fa.id and alice.responses.retrieve(ra.id).id == ra.id
    _not_found(srv, "bob", "GET", f"/v1/files/{fa.id}", f"/v1/files/{UNKNOWN_FILE}")
    _not_found(srv, "bob", "GET", f"/v1/responses/{ra.id}", f"/v1/responses/{UNKNOWN_RESP}")
    for who in ("alice", "bob"):
        _not_found(srv, who, "GET", f"/v1/files/{legacy.id}", f"/v1/files/{UNKNOWN_FILE}")
        assert legacy.id not in {f.id for f in srv.client(who).files.list()}
    assert ops.files.retrieve(legacy.id).id == legacy.id and legacy.id in {f.id for f in ops.files.list()}


def test_no_key_reaches_the_log(srv):
    assert srv.raw("alice", "GET", "/v1/models").status_code == 200
    r = httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {WRONG_KEY}"}, timeout=30)
    assert r.status_code == 401 and WRONG_KEY not in r.text
    r = httpx.get(srv.url + "/v1/models", headers={"x-api-key": WRONG_KEY}, timeout=30)
    assert r.status_code == 401
    text = "".join(open(path).read() for path in srv.logs)
    assert "4 API keys (1 admin)" in text
    for secret in (*KEYS.values(), WRONG_KEY):
        assert secret not in text


def test_a_bad_keys_file_stops_serve_before_the_load_without_quoting_it(tmp_path):
    bad = tmp_path / "keys"
    bad.write_text(f"{KEYS['alice']} alice\n{KEYS['bob']} al!ce\n")
    run = subprocess.run(
        [sys.executable, "-m", "llmkit.cli.main", "serve", "--api-keys-file", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "line 2, field 2" in run.stderr
    for secret in (KEYS["alice"], KEYS["bob"], "al!ce"):
        assert secret not in run.stdout + run.stderr
