"""``--lora-resolver storage``: adapters found by name in the storage backend (``loras/<name>/``),
served from a real S3-compatible endpoint on loopback (moto's server) through the real server and
the ``openai`` client; the assets of the local backend; names that try to leave ``loras/``."""

from __future__ import annotations

import os

import httpx
import openai
import pytest

from llmkit.core.batches.storage import NotFoundError
from llmkit.plugins.storage.local import LocalStorage

from lora_utils import save_adapter, save_tiny_llama
from server_utils import start_server, stop_server

PROMPT = "Hello there"


def _text(client, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text


@pytest.mark.slow
def test_adapters_from_an_s3_bucket_load_on_first_use_and_evict(tmp_path):
    pytest.importorskip("moto.server")
    import boto3

    from s3_utils import make_bucket, moto_endpoint

    save_tiny_llama(tmp_path / "base")
    for name, seed in (("a", 1), ("b", 2)):
        save_adapter(tmp_path / "base", tmp_path / name, seed=seed, r=4)
    with moto_endpoint() as endpoint:
        make_bucket(endpoint, "loras")
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        for name in ("a", "b"):
            for file in ("adapter_config.json", "adapter_model.safetensors"):
                s3.upload_file(str(tmp_path / name / file), "loras", f"llmkit/loras/{name}/{file}")
        # an adapter whose weights were never uploaded
        s3.upload_file(str(tmp_path / "a" / "adapter_config.json"), "loras", "llmkit/loras/w/adapter_config.json")
        s3.put_object(Bucket="loras", Key="llmkit/blobs/a", Body=b"not an adapter")
        args = ["--model-path", str(tmp_path / "base"), "--device", "cpu", "--batch-storage", "s3"]
        args += ["--storage-option", "bucket=loras", "--storage-option", f"endpoint_url={endpoint}"]
        proc, url = start_server([*args, "--lora-resolver", "storage", "--max-loaded-loras", "1"])
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
            listed = lambda: {m.id for m in client.models.list().data}  # noqa: E731
            base = _text(client, "m")
            first_a = _text(client, "a")  # fetched from the bucket and loaded
            assert first_a != base and "a" in listed()
            assert _text(client, "b") != first_a
            assert "a" not in listed() and "b" in listed()  # a was the least recently used
            assert _text(client, "a") == first_a  # fetched again: the same adapter
            for name in ("nope", "..", "../blobs/a", "a/../b"):
                r = httpx.post(url + "/v1/completions", json={"model": name, "prompt": "x"}, timeout=60)
                assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", (name, r.text)
            with pytest.raises(openai.BadRequestError, match="adapter_model.safetensors"):
                _text(client, "w")
            assert _text(client, "a") == first_a  # serving on
        finally:
            stop_server(proc)


def test_local_storage_assets_stay_inside_the_storage_directory(tmp_path):
    store = LocalStorage(str(tmp_path / "store"))
    (tmp_path / "store" / "loras" / "a").mkdir(parents=True)
    (tmp_path / "store" / "loras" / "a" / "adapter_config.json").write_text("{}")
    (tmp_path / "secret").write_text("outside")
    os.symlink(tmp_path / "secret", tmp_path / "store" / "loras" / "a" / "link")
    assert store.stores_assets
    assert b"".join(store.read_asset("loras/a/adapter_config.json")) == b"{}"
    for key in ("loras/a/link", "../secret", "loras/../../secret", "/etc/passwd", "loras//a", "", "loras/a/missing"):
        with pytest.raises(NotFoundError):
            b"".join(store.read_asset(key))
    store.close()
