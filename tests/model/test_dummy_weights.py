"""``load_format="dummy"``: an engine from config.json + tokenizer alone, with seeded random weights."""

from __future__ import annotations

import math
import shutil
import threading

import pytest
import torch

from llmkit.core.engine.builder import build_engine_parts
from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.loop import Engine
from llmkit.core.engine.messages import GenerateRequest, SamplingParams
from llmkit.core.model.layers import RMSNorm
from llmkit.core.model.loader.source import resolve_model_dir

from model_utils import tiny_config


@pytest.fixture(scope="module")
def config_only_dir(tmp_path_factory):
    """A model directory with config.json and tokenizer files but no weights."""
    d = tmp_path_factory.mktemp("dummy-model")
    cfg = tiny_config("qwen2")
    cfg.architectures = ["Qwen2ForCausalLM"]  # what a checkpoint's config.json names
    cfg.save_pretrained(str(d))
    for f in resolve_model_dir(None).iterdir():  # the embedded model's tokenizer (vocab > 512)
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, d / f.name)
    assert not list(d.glob("*.safetensors"))
    return d


def _generate(engine: Engine, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    done, tokens, lps = threading.Event(), [], []

    def sink(o):
        tokens.extend(o.token_ids)
        lps.extend(lp.logprob for lp in o.logprobs)
        if o.finished:
            done.set()

    params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, logprobs=True)
    engine.submit(GenerateRequest("dummy-0", ids, params), sink)
    assert done.wait(60)
    return tokens, lps


def _build_and_generate(model_dir) -> tuple[list[int], list[float]]:
    cfg = EngineConfig(
        grammar_backend="none",
        model_path=str(model_dir),
        load_format="dummy",
        device="cpu",
        attention="torch",
        dtype="float32",
        max_total_tokens=256,
    )
    parts = build_engine_parts(cfg)
    for m in parts.model.modules():
        if isinstance(m, RMSNorm):
            assert torch.all(m.weight == 1.0)
    for name, p in parts.model.named_parameters():
        if name.endswith(("proj.weight", "proj.bias", "embed_tokens.weight")):
            assert p.abs().max() <= 1e-3 and p.abs().max() > 0, name  # filled, small
    engine = Engine(cfg, parts)
    engine.start()
    try:
        return _generate(engine, [5, 17, 99, 250, 7, 401], 8)
    finally:
        engine.shutdown()


def test_dummy_engine_generates_reproducibly(config_only_dir):
    tokens, lps = _build_and_generate(config_only_dir)
    assert len(tokens) == 8 and all(0 <= t < 512 for t in tokens)
    assert len(lps) == 8 and all(math.isfinite(x) for x in lps)
    assert _build_and_generate(config_only_dir) == (tokens, lps)  # seeded: same weights each build


def test_unknown_load_format_lists_valid_ones(tmp_path):
    from llmkit.core.refusals import check_configs
    from llmkit.core.server.config import ServerConfig

    # The model path does not exist: the format must be rejected before anything is looked at.
    with pytest.raises(ValueError, match=r"unknown --load-format 'pt'.*auto, dummy"):
        check_configs(
            EngineConfig(model_path=str(tmp_path / "missing"), load_format="pt", device="cpu"), ServerConfig()
        )


def test_config_without_architectures_falls_back_to_model_type():
    from llmkit.core.engine.builder import architecture_of

    assert architecture_of({"model_type": "qwen2"}) == "Qwen2ForCausalLM"
    assert architecture_of({"architectures": ["LlamaForCausalLM"], "model_type": "qwen2"}) == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="names no 'architectures'.*'gpt2'"):
        architecture_of({"model_type": "gpt2"})
