"""``--model-path org/name`` and ``org/repo:QUANT`` resolved from a hub cache laid out on disk,
offline (huggingface_hub's own lookup, with the cache pointed at a temporary HF_HOME)."""

from __future__ import annotations

import pytest

from llmkit.core.engine.config import EngineConfig
from llmkit.core.model.loader.hub import HubModelNotFound, parse_hub_ref, pick_gguf, resolve_hub_model
from llmkit.core.option import OptionError
from llmkit.core.refusals import _resolve_hub_id
from llmkit.core.server.config import ServerConfig

from hub_utils import hub_cache, hub_snapshot


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache(tmp_path)))
    return tmp_path


def _dir_model(hf_home, repo_id="acme/tiny-chat", **kw):
    snapshot = hub_snapshot(hf_home, repo_id, **kw)
    (snapshot / "config.json").write_text("{}")
    return snapshot


def test_an_id_resolves_to_its_snapshot_through_refs_main(hf_home):
    snapshot = _dir_model(hf_home)
    assert resolve_hub_model("acme/tiny-chat") == str(snapshot)


def test_revision_picks_another_snapshot(hf_home):
    _dir_model(hf_home)
    other = _dir_model(hf_home, commit="f" * 40, ref="v2")
    assert resolve_hub_model("acme/tiny-chat", revision="v2") == str(other)
    assert resolve_hub_model("acme/tiny-chat", revision="f" * 40) == str(other)


@pytest.mark.parametrize(
    "tag,expected",
    [("Q4_1", "m.Q4_1.gguf"), ("q8_0", "m-Q8_0.gguf"), (None, "m-Q4_K_M.gguf")],
)
def test_a_tag_picks_its_gguf_case_insensitively(hf_home, tag, expected):
    snapshot = hub_snapshot(hf_home, "acme/m-GGUF")
    for name in ("m.Q4_1.gguf", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "mmproj-m-Q8_0.gguf", "README.md"):
        (snapshot / name).write_text("")
    ref = "acme/m-GGUF" + (f":{tag}" if tag else "")
    assert resolve_hub_model(ref) == str(snapshot / expected)


def test_gguf_choice_follows_llama_cpp():
    assert pick_gguf(["a-Q8_0.gguf", "a-Q2_K.gguf"], None) == "a-Q8_0.gguf"  # no Q4_K_M: the first
    assert pick_gguf(["mmproj-a-Q8_0.gguf"], None) is None  # a projector is no model
    assert pick_gguf(["a-Q8_0.gguf"], "Q5_K_M") is None


def test_a_missing_tag_names_the_snapshot(hf_home):
    snapshot = hub_snapshot(hf_home, "acme/m-GGUF")
    (snapshot / "m-Q8_0.gguf").write_text("")
    with pytest.raises(HubModelNotFound, match=f"{snapshot} holds no .gguf file tagged Q3_K_S"):
        resolve_hub_model("acme/m-GGUF:Q3_K_S")


def test_a_missing_id_names_where_it_looked(hf_home):
    with pytest.raises(HubModelNotFound) as err:
        resolve_hub_model("acme/absent")
    msg = str(err.value)
    assert "--model-path 'acme/absent' was not found" in msg
    assert str(hub_cache(hf_home)) in msg and "HF_HUB_OFFLINE=1" in msg and "hf download acme/absent" in msg


def test_a_local_path_wins_over_an_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme" / "local").mkdir(parents=True)
    assert parse_hub_ref("acme/local") is None
    assert parse_hub_ref("acme/remote") == ("acme/remote", None)
    assert parse_hub_ref("acme/remote-GGUF:Q4_K_M") == ("acme/remote-GGUF", "Q4_K_M")
    for not_an_id in ("model.gguf", "a/b/c", "/abs/path", "acme/x--y", "acme/"):
        assert parse_hub_ref(not_an_id) is None


def test_configs_get_the_local_path_and_the_id_as_served_name(hf_home):
    snapshot = _dir_model(hf_home)
    engine, server = _resolve_hub_id(EngineConfig(model_path="acme/tiny-chat"), ServerConfig())
    assert (engine.model_path, server.served_model_name) == (str(snapshot), "acme/tiny-chat")
    _, named = _resolve_hub_id(EngineConfig(model_path="acme/tiny-chat"), ServerConfig(served_model_name="x"))
    assert named.served_model_name == "x"
    with pytest.raises(OptionError, match="acme/absent"):
        _resolve_hub_id(EngineConfig(model_path="acme/absent"), ServerConfig())


def test_an_unreachable_hub_falls_back_to_the_cache(hf_home, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # refused at once
    snapshot = _dir_model(hf_home)
    assert resolve_hub_model("acme/tiny-chat") == str(snapshot)
    with pytest.raises(HubModelNotFound, match="nor downloaded: LocalEntryNotFoundError"):
        resolve_hub_model("acme/absent")
