"""The Hugging Face id inferred from a model's path or config (served as an alias of the model)."""

from __future__ import annotations

import json

import pytest

from llmkit.core.model.loader.hf_model_id import hf_model_id


def test_embedded_model_has_its_hub_id():
    assert hf_model_id(None) == "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.parametrize(
    "path,expected",
    [
        ("/root/.cache/huggingface/hub/models--Qwen--Qwen2.5/snapshots/7ae557", "Qwen/Qwen2.5"),
        ("/x/hub/models--qwen--qwen2.5-0.5b-instruct/snapshots/abc/", "qwen/qwen2.5-0.5b-instruct"),
        ("/x/hub/models--bartowski--Qwen2.5-GGUF/snapshots/abc/q4/Qwen2.5-Q4_K_M.gguf", "bartowski/Qwen2.5-GGUF"),
        ("/x/hub/models--gpt2/snapshots/abc", "gpt2"),  # an id without an organization
        ("/x/hub/models--a--b--c/snapshots/abc", None),  # no hub id has three parts
        ("/x/hub/models--Qwen--Qwen2.5/refs/main", None),  # not a snapshot
    ],
)
def test_hub_cache_path(path, expected):
    assert hf_model_id(path) == expected


@pytest.mark.parametrize(
    "path,expected",
    [
        ("/data/models/meta-llama/Meta-Llama-3.1-8B-Instruct", "meta-llama/Meta-Llama-3.1-8B-Instruct"),
        ("/srv/llm/Qwen/Qwen2.5-0.5B-Instruct/", "Qwen/Qwen2.5-0.5B-Instruct"),
        ("/srv/llm/bartowski/Qwen2.5-GGUF/Qwen2.5-Q4_K_M.gguf", "bartowski/Qwen2.5-GGUF"),
        ("/srv/llm/Qwen/Qwen2.5/../Qwen3-0.6B", "Qwen/Qwen3-0.6B"),
    ],
)
def test_org_name_directory(path, expected):
    assert hf_model_id(path) == expected


@pytest.mark.parametrize(
    "path",
    [
        "/tmp/my-model",  # a top-level folder, and the temp directory
        "/data/my-model",
        "/home/alice/my-model",  # someone's home
        "/srv/models/my-model",  # generic folder names
        "/srv/x/checkpoints/step-500",
        "/srv/x/llm/my-model",
        "/srv/x/Qwen/.hidden",  # not hub name parts
        "/srv/x/my org/my-model",
        "/srv/x/a--b/my-model",
    ],
)
def test_non_hub_paths_yield_nothing(path):
    assert hf_model_id(path) is None


def test_home_temp_and_current_directories_are_no_organization(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "alice"))
    assert hf_model_id(str(tmp_path / "alice" / "my-model")) is None
    monkeypatch.chdir(tmp_path)
    assert hf_model_id("my-model") is None
    assert hf_model_id(str(tmp_path / "org" / "name")) == "org/name"


def _model_dir(root, name_or_path):
    d = root / "checkpoints" / "run1"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "_name_or_path": name_or_path}))
    return str(d)


@pytest.mark.parametrize(
    "name_or_path,expected",
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
        ("/home/alice/out/final", None),  # a local path the trainer saved from
        ("./out/final", None),
        ("output/checkpoint-500", None),
        ("gpt2", None),  # one part: a local folder as likely as a hub id
        ("", None),
        (7, None),
    ],
)
def test_config_name_or_path(tmp_path, name_or_path, expected):
    assert hf_model_id(_model_dir(tmp_path, name_or_path)) == expected


def test_path_wins_over_config(tmp_path):
    d = tmp_path / "models--Org--Name" / "snapshots" / "abc"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"_name_or_path": "Base/Model"}))
    assert hf_model_id(str(d)) == "Org/Name"
