"""LoRA through a real ``llmkit serve`` and the official ``openai`` client: adapters picked by
``model`` (or SGLang's ``lora_path``), listed in /v1/models with their parent, loaded and unloaded
at run time behind the API key, bad adapters refused with a 400 while the server serves on, and
the prefix cache kept per adapter."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from lora_utils import save_adapter, save_tiny_llama
from server_utils import start_server, stop_server

KEY = "sk-lora-test"
PROMPT = "The quick brown fox jumps over the lazy dog and keeps running"
SHORT = "Say hi"  # under --dp-size: too short for the replica router's prefix blocks


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serve")
    save_tiny_llama(root / "base")
    for name, seed, r in (("a", 1, 8), ("b", 2, 4), ("c", 3, 4), ("big", 4, 16)):
        save_adapter(root / "base", root / name, seed=seed, r=r)
    template = root / "chat.jinja"  # the byte-level tokenizer brings none
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    args = ["--model-path", str(root / "base"), "--device", "cpu", "--api-key", KEY, "--max-lora-rank", "8"]
    args += ["--chat-template", str(template)]
    proc, url = start_server([*args, "--lora-paths", f"a={root / 'a'}", f"b={root / 'b'}"])
    try:
        yield url, root
    finally:
        stop_server(proc)


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _complete(client, model, prompt=PROMPT):
    r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens


def _post(url, path, body, key=KEY):
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def test_adapters_are_models_with_a_parent(server):
    url, root = server
    client = _client(url)
    models = {m.id: m for m in client.models.list().data}
    assert {"a", "b"} <= models.keys()
    base = next(m for m in models.values() if getattr(m, "parent", None) is None)
    assert models["a"].parent == base.id and models["a"].root == str(root / "a")
    assert client.models.retrieve("b").parent == base.id
    outs = {m: _complete(client, m, "Once upon a time")[0] for m in ("m", "a", "b")}
    assert len(set(outs.values())) == 3  # each adapter changes the output
    chat = client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert chat.model == "a" and chat.choices[0].message.content is not None

    def gen(**kw):
        return _post(
            url, "/generate", {"text": "Once", "sampling_params": {"max_new_tokens": 6, "temperature": 0}, **kw}
        )

    by_model, by_path, plain = gen(model="b").json(), gen(lora_path="b").json(), gen().json()
    assert by_model["output_ids"] == by_path["output_ids"] != plain["output_ids"]
    with pytest.raises(openai.NotFoundError, match="LoRA adapters: `a`, `b`") as exc:
        _complete(client, "no-such-adapter")
    assert exc.value.code == "model_not_found"
    assert gen(lora_path="no-such-adapter").status_code == 404


def test_prefix_cache_is_per_adapter(server):
    url, _ = server
    client = _client(url)
    prompt = PROMPT + " through the forest"
    a1, cached = _complete(client, "a", prompt)
    assert cached == 0  # nothing cached yet: computed alone
    b1, cached = _complete(client, "b", prompt)
    assert cached == 0  # a's K/V of the same prompt is not b's
    _, cached = _complete(client, "m", prompt)
    assert cached == 0
    a2, cached = _complete(client, "a", prompt)
    assert cached > 0 and a2 == a1  # a hits its own prefix, with the same output
    b2, cached = _complete(client, "b", prompt)
    assert cached > 0 and b2 == b1


def test_load_use_unload_and_bad_adapters(server, tmp_path):
    url, root = server
    client = _client(url)
    body = {"lora_name": "c", "lora_path": str(root / "c")}
    assert _post(url, "/load_lora_adapter", body, key="wrong").status_code == 401
    r = _post(url, "/load_lora_adapter", body)
    assert r.status_code == 200, r.text
    assert "c" in {m.id for m in client.models.list().data}
    c_out = _complete(client, "c")[0]
    assert _post(url, "/load_lora_adapter", body).status_code == 400  # the name is taken
    bad = tmp_path / "corrupt"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((root / "c" / "adapter_config.json").read_text())
    (bad / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    for path, why in (
        (root / "big", "rank 16 is over --max-lora-rank 8"),
        (bad, "cannot be read"),
        (tmp_path / "none", "not a directory"),
    ):
        r = _post(url, "/load_lora_adapter", {"lora_name": "x", "lora_path": str(path)})
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    assert "x" not in {m.id for m in client.models.list().data}
    assert _post(url, "/unload_lora_adapter", {"lora_name": "c"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "c")
    assert _post(url, "/unload_lora_adapter", {"lora_name": "c"}).status_code == 404
    assert _post(url, "/load_lora_adapter", body).status_code == 200  # reloaded
    assert _complete(client, "c")[0] == c_out
    assert _complete(client, "a")[0]  # serving on


def test_paths_the_server_cannot_read_are_400s(server):
    """A path over NAME_MAX, one this process may not read (/proc/1/root without ptrace rights;
    with them, a directory with no adapter in it) and a home that does not exist: a 400 naming
    the adapter, never the stat's OSError as a 500."""
    url, _ = server
    for path, why in (
        ("/tmp/" + "x" * 300, "File name too long"),
        ("/proc/1/root", "LoRA adapter 'x'"),
        ("~no-such-user-here/adapter", "LoRA adapter 'x'"),
    ):
        r = _post(url, "/load_lora_adapter", {"lora_name": "x", "lora_path": path})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "lora_path" and why in r.json()["error"]["message"], r.text
    assert _complete(_client(url), "a")[0]  # serving on


def _variant(src, dest, *, alpha=None, times=None):
    """A copy of the adapter at ``src`` with ``lora_alpha`` set to the JSON text ``alpha``, or
    every weight multiplied by ``times``."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    if alpha is not None:
        cfg = json.loads((dest / "adapter_config.json").read_text())
        cfg["lora_alpha"] = "ALPHA"
        (dest / "adapter_config.json").write_text(json.dumps(cfg).replace('"ALPHA"', alpha))
    if times is not None:
        weights = dest / "adapter_model.safetensors"
        save_file({k: t * times for k, t in load_file(str(weights)).items()}, str(weights))
    return dest


def test_adapters_whose_scaled_weights_are_not_finite_are_400s(server, tmp_path):
    """lora_alpha 1e300 (finite, but not once folded into float weights), Infinity, NaN, and
    weights of 1e18 (finite, but their delta overflows any activation): each a 400 at load naming
    the problem, where they loaded with 200 and then generated empty text."""
    url, root = server
    client = _client(url)
    for i, (kw, why) in enumerate(
        (
            ({"alpha": "1e300"}, "its delta could reach"),
            ({"alpha": "Infinity"}, "not a finite number"),
            ({"alpha": "NaN"}, "not a finite number"),
            ({"times": 1e18}, "its delta could reach"),
        )
    ):
        path = _variant(root / "c", tmp_path / f"v{i}", **kw)
        r = _post(url, "/load_lora_adapter", {"lora_name": f"v{i}", "lora_path": str(path)})
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    assert not {m.id for m in client.models.list().data} & {"v0", "v1", "v2", "v3"}
    fine = _variant(root / "c", tmp_path / "fine", alpha="64")  # a large scale, finite deltas: served
    assert _post(url, "/load_lora_adapter", {"lora_name": "fine", "lora_path": str(fine)}).status_code == 200
    assert _complete(client, "fine")[0]
    assert _post(url, "/unload_lora_adapter", {"lora_name": "fine"}).status_code == 200


def test_streaming_equals_non_streaming(server):
    url, _ = server
    client = _client(url)
    whole = _complete(client, "b", "Streaming or not")[0]
    stream = client.completions.create(model="b", prompt="Streaming or not", max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == whole


@pytest.mark.parametrize("where", [["--engine-process"], ["--dp-size", "2"]], ids=["engine-process", "dp2"])
def test_run_time_loading_out_of_the_server_process(tmp_path, where):
    """The engine in its own process loads and unloads through the same routes (its IPC calls);
    under --dp-size every replica does, and a replica that dies comes back with the adapters the
    others serve (a start-up one unloaded, a run-time one loaded)."""
    save_tiny_llama(tmp_path / "base")
    save_adapter(tmp_path / "base", tmp_path / "a", seed=1, r=4)
    save_adapter(tmp_path / "base", tmp_path / "s", seed=2, r=4)
    args = ["--model-path", str(tmp_path / "base"), "--device", "cpu", "--lora-paths", f"s={tmp_path / 's'}"]
    proc, url = start_server([*args, *where])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="None", max_retries=0, timeout=120)
        assert _post(url, "/load_lora_adapter", {"lora_name": "a", "lora_path": str(tmp_path / "a")}).status_code == 200
        a_out = _complete(client, "a", SHORT)[0]
        assert a_out != _complete(client, "m", SHORT)[0]
        r = _post(url, "/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "none")})
        assert r.status_code == 400 and "not a directory" in r.text
        assert _post(url, "/unload_lora_adapter", {"lora_name": "s"}).status_code == 200
        if "--dp-size" in where:
            info = httpx.get(url + "/get_server_info", timeout=30).json()
            pid = info["replicas"][1]["pid"]
            os.kill(pid, signal.SIGKILL)
            _wait_replica_back(url, 1, pid)
            routed = [r["routed"] for r in httpx.get(url + "/get_server_info", timeout=30).json()["replicas"]]
            # prompts under 32 tokens rotate over the replicas: both answer as the adapter makes them
            assert all(_complete(client, "a", SHORT)[0] == a_out for _ in range(4))
            after = [r["routed"] for r in httpx.get(url + "/get_server_info", timeout=30).json()["replicas"]]
            assert all(b > a for a, b in zip(routed, after)), (routed, after)
            for _ in range(2):
                with pytest.raises(openai.NotFoundError):
                    _complete(client, "s")
        assert _post(url, "/unload_lora_adapter", {"lora_name": "a"}).status_code == 200
        with pytest.raises(openai.NotFoundError):
            _complete(client, "a")
    finally:
        stop_server(proc)


def _wait_replica_back(url: str, rank: int, old_pid: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        rep = info["replicas"][rank]
        if rep["alive"] and rep["pid"] != old_pid:
            return
        time.sleep(0.5)
    raise AssertionError(f"replica {rank} did not come back within {timeout:g} s")


def test_lora_dir_loads_on_first_use_and_evicts_the_least_recently_used(tmp_path):
    save_tiny_llama(tmp_path / "base")
    adapters = tmp_path / "adapters"
    for name, seed, r in (("a", 1, 4), ("b", 2, 4), ("big", 3, 16)):
        save_adapter(tmp_path / "base", adapters / name, seed=seed, r=r)
    args = ["--model-path", str(tmp_path / "base"), "--device", "cpu", "--max-lora-rank", "8"]
    proc, url = start_server([*args, "--lora-dir", str(adapters), "--max-loaded-loras", "1"])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="None", max_retries=0, timeout=120)
        listed = lambda: {m.id for m in client.models.list().data}  # noqa: E731
        first_a = _complete(client, "a")[0]  # loaded on first use
        assert "a" in listed()
        assert _complete(client, "b")[0] != first_a
        assert "a" not in listed() and "b" in listed()  # a was the least recently used
        assert _complete(client, "a")[0] == first_a  # back, the same adapter
        for name in ("../base", "no-such", ".hidden"):
            with pytest.raises(openai.NotFoundError):
                _complete(client, name)
        with pytest.raises(openai.BadRequestError, match="over --max-lora-rank 8"):
            _complete(client, "big")
        assert _complete(client, "a")[0] == first_a  # serving on
    finally:
        stop_server(proc)
