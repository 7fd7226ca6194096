"""Tenant isolation of the prefix cache in a real ``llmkit serve`` with a keys file: a prefix one
owner computed is reused by that owner only (before, a second owner's identical prompt reported
the first one's tokens as cached, a timing side channel), unless the keys file puts both keys in
one ``cache=SPACE``; vLLM's ``cache_salt`` gives a client a space of its own within its key's."""

from __future__ import annotations

import openai
import pytest

from server_utils import start_server, stop_server

KEYS = """
sk-alice-0000000000000001 alice
sk-bob-000000000000000002 bob
sk-carol-0000000000000003 carol cache=team
sk-dave-00000000000000004 dave cache=team
"""
PROMPT = " ".join(f"Rule {i}: answer in the voice of a {['pirate', 'poet', 'clerk'][i % 3]}." for i in range(30))


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(KEYS)
    proc, base = start_server(["--api-keys-file", str(keys), "--page-size", "16"])
    yield base
    stop_server(proc)


def _cached(url: str, key: str, **extra) -> int:
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300)
    out = client.chat.completions.create(
        model="m",
        messages=[{"role": "system", "content": PROMPT}, {"role": "user", "content": "Hi."}],
        max_tokens=2,
        temperature=0,
        extra_body=extra or None,
    )
    return out.usage.prompt_tokens_details.cached_tokens


def test_prefixes_are_reused_only_within_an_owner_or_a_shared_space(url):
    assert _cached(url, "sk-alice-0000000000000001") == 0
    assert _cached(url, "sk-alice-0000000000000001") > 200  # alice's own prefix
    assert _cached(url, "sk-bob-000000000000000002") == 0  # not alice's
    assert _cached(url, "sk-carol-0000000000000003") == 0
    assert _cached(url, "sk-dave-00000000000000004") > 200  # cache=team: carol's
    assert _cached(url, "sk-alice-0000000000000001", cache_salt="s1") == 0  # a space of its own
    assert _cached(url, "sk-alice-0000000000000001", cache_salt="s1") > 200
    assert _cached(url, "sk-bob-000000000000000002", cache_salt="s1") == 0  # within bob's key only
