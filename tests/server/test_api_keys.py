"""API keys: the keys-file parser, which key is the admin, constant-time matching, and the key
check in-process (the fake engine) over both header forms; ownership end to end is in
test_ownership_e2e.py."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from llmkit.core.server.access.keys import KeyRing, KeysFileError, digest, hashed_owner, load_keys, parse_keys_file

from fake_engine import fake_app

SECRET = "sk-very-secret-0123"


def _file(tmp_path, text: str) -> str:
    path = tmp_path / "keys"
    path.write_text(text)
    return str(path)


def test_keys_file_format():
    text = """
# KEY  [NAME]  [admin]  [rpm=N] [tpm=N]

sk-a alice
  sk-b   bob admin   # a trailing comment
sk-c\tcarol rpm=5 tpm=1000
sk-d
sk#e  dave  # a '#' inside a key is part of it
sk-f admin
"""
    keys = [k for _, k in parse_keys_file(text)]
    assert [(k.owner, k.admin, k.rpm, k.tpm) for k in keys] == [
        ("alice", False, None, None),
        ("bob", True, None, None),
        ("carol", False, 5, 1000),
        (hashed_owner("sk-d"), False, None, None),
        ("dave", False, None, None),
        (hashed_owner("sk-f"), True, None, None),
    ]
    assert keys[4].digest == digest("sk#e")
    assert [n for n, _ in parse_keys_file(text)] == [4, 5, 6, 7, 8, 9]


def test_a_keys_prefix_cache_space_is_its_owners_unless_the_file_names_one():
    from llmkit.core.server.access.owners import cache_salt

    text = "sk-a1 alice\nsk-b2 bob cache=team\nsk-c3 carol cache=team admin\nsk-d4 dave cache=shared\n"
    alice, bob, carol, dave = [k for _, k in parse_keys_file(text)]
    assert alice.cache_scope == "owner:alice" and bob.cache_scope == carol.cache_scope == "space:team"
    assert dave.cache_scope is None  # the space of a server without keys
    assert carol.admin
    # a request's cache_salt narrows its key's space, never leaves it
    assert len({cache_salt("owner:alice", "x"), cache_salt("space:team", "x"), cache_salt(None, "x")}) == 3
    assert cache_salt("owner:alice", None) == "owner:alice" and cache_salt(None, None) is None


def test_an_unnamed_key_is_owned_by_a_stable_hash_that_is_not_the_key():
    owner = hashed_owner(SECRET)
    assert owner == hashed_owner(SECRET) and owner.startswith("key-") and len(owner) == 20
    assert SECRET not in owner and owner[4:] not in digest(SECRET).hex()  # not a prefix of the compared digest


@pytest.mark.parametrize(
    "text,error",
    [
        (f"{SECRET} al!ce\n", "line 1, field 2: a name is"),
        (f"{SECRET} alice bob\n", "line 1, field 3: expected admin, rpm=N, tpm=N or cache=SPACE"),
        (f"{SECRET} alice rpm=x\n", "line 1, field 3"),
        (f"sk-x a\n{SECRET} b\n{SECRET} c\n", "line 3: the same key as"),
        (f"sk-x alice\n{SECRET} alice\n", "line 2: the same name as"),
        ("# only a comment\n\n", "holds no key"),
    ],
)
def test_bad_keys_files_say_which_line_and_never_quote_it(tmp_path, text, error):
    with pytest.raises(KeysFileError) as exc:
        load_keys((), _file(tmp_path, text))
    message = str(exc.value)
    assert error in message
    assert SECRET not in message and "al!ce" not in message and "rpm=x" not in message


def test_an_unreadable_keys_file_is_an_error(tmp_path):
    with pytest.raises(KeysFileError, match="cannot be read"):
        load_keys((), str(tmp_path / "missing"))


def test_a_lone_api_key_is_the_admin_and_several_are_not(tmp_path):
    (lone,) = load_keys(["k1"])
    assert lone.admin and lone.owner == hashed_owner("k1")
    assert [k.admin for k in load_keys(["k1", "k2"])] == [False, False]
    # beside a keys file, an --api-key is a plain key too
    assert [(k.owner, k.admin) for k in load_keys(["k1"], _file(tmp_path, "k2 ops admin\n"))] == [
        (hashed_owner("k1"), False),
        ("ops", True),
    ]
    assert load_keys(["", ""]) == []  # --api-key "" is no key, as before
    with pytest.raises(KeysFileError, match="--api-key #2: the same key as --api-key #1"):
        load_keys(["k1", "k1"])


def test_keys_are_not_in_their_repr():
    (key,) = load_keys([SECRET])
    assert SECRET not in repr(key) and digest(SECRET).hex() not in repr(key)


def test_key_ring_matches_every_key():
    keys = load_keys(["k1", "k2", "k3"])
    ring = KeyRing(keys)
    assert [ring.match(k) for k in ("k1", "k2", "k3")] == keys
    assert ring.match("k4") is None and ring.match("") is None


@pytest.fixture
def http(tmp_path):
    keys = _file(tmp_path, "sk-alice alice\nsk-ops ops admin\n")
    with TestClient(fake_app(api_keys=("sk-cli",), api_keys_file=keys)) as client:
        yield client


@pytest.mark.parametrize("key", ["sk-alice", "sk-ops", "sk-cli"])
def test_every_key_is_accepted_in_either_header(http, key):
    assert http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert http.get("/v1/models", headers={"x-api-key": key}).status_code == 200


def test_a_wrong_key_is_401_in_the_api_shape(http):
    r = http.get("/v1/models", headers={"Authorization": "Bearer sk-alicf"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert "sk-alic" not in r.text
    r = http.post("/v1/messages", headers={"x-api-key": "nope"}, json={})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert http.get("/health").status_code == 200  # still open


def test_without_keys_nothing_is_asked():
    with TestClient(fake_app()) as client:
        assert client.get("/v1/models").status_code == 200
