"""The transformers fallback (``--model-impl``): architectures without a native llmkit class run
transformers' modeling code with llmkit's paged attention, and match transformers' ``generate``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import openai
import pytest
import torch
import transformers
from hybrid_utils import run_prompts

from llmkit.core.engine.stages.plan import model_class
from llmkit.core.plugins import PluginError

from model_utils import assert_greedy_matches_generate, copy_embedded_tokenizer, save_tiny_model, start_engine
from server_utils import start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from model_coverage import tiny_config  # noqa: E402  (the coverage benchmark's tiny configs)

# eight architectures transformers ships that llmkit has no class for: rotary variants (partial,
# parallel attention+MLP), learned positions with self-scaled queries (OPT), Cohere 2's sliding
# windows with NoPE global layers, Q/K norms (Exaone 4, Hunyuan), attention biases (Seed-OSS),
# multi-query attention (GPT-BigCode), experts fused by transformers at load (Qwen2-MoE), and a
# model saved under its parent's class name (Exaone's config.json says LlamaForCausalLM)
FALLBACK_TYPES = (
    "gpt_neox", "opt", "cohere2", "ernie4_5", "exaone4", "hunyuan_v1_dense", "seed_oss", "starcoder2",
    "gpt_bigcode", "qwen2_moe", "exaone",
)  # fmt: skip


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + 11 * i) % 500 + 1 for i in range(n)]


def save_tiny(model_type: str, path: Path, **overrides):
    torch.manual_seed(0)
    cfg = tiny_config(model_type)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(str(path))
    copy_embedded_tokenizer(path)
    return model.eval()


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("model_type", FALLBACK_TYPES)
def test_fallback_matches_generate(tmp_path, model_type):
    """Greedy tokens equal transformers' on a prompt longer than Cohere 2's window (16 tokens), and
    again when the second prompt extends the first (a prefix-cache hit, chunked prefill)."""
    ref = save_tiny(model_type, tmp_path, **({"sliding_window": 16} if model_type == "cohere2" else {}))
    assert model_class(_config(tmp_path)).__name__ == "TransformersForCausalLM"
    first = _prompt(1, 40)
    cached = assert_greedy_matches_generate(ref, tmp_path, [first, first + _prompt(2, 7)], n=12)
    assert cached[0] == 0 and cached[1] >= 32


def test_batch_invariant_and_abort(tmp_path):
    """Requests batched together get the tokens each gets alone; an aborted one frees its pages."""
    save_tiny("gpt_neox", tmp_path)
    engine = start_engine(model_path=str(tmp_path), device="cpu", page_size=4, chunked_prefill_size=16)
    try:
        prompts = [_prompt(s, 20 + 7 * s) for s in range(4)]
        together = run_prompts(engine, prompts, 10)
        alone = [run_prompts(engine, [p], 10)[0] for p in prompts]
        assert [t for t, _ in together] == [t for t, _ in alone]
        run_prompts(engine, prompts[:2], 10, abort_after={0: 3})
        stats = engine.call(engine.stats).result(timeout=60)
        assert stats["num_running_reqs"] == 0
    finally:
        engine.shutdown()


def test_model_impl_transformers_on_a_native_architecture(tmp_path):
    """``--model-impl transformers`` serves a Llama through transformers' code: the same tokens
    as the native class (and as transformers)."""
    ref = save_tiny_model("llama", tmp_path)
    copy_embedded_tokenizer(tmp_path)
    prompts = [_prompt(3, 30)]
    assert_greedy_matches_generate(ref, tmp_path, prompts, n=10, model_impl="transformers")
    assert_greedy_matches_generate(ref, tmp_path, prompts, n=10, model_impl="llmkit")


def test_refusals(tmp_path):
    """A model the fallback cannot run, or a native-only request for a fallback model, fails at
    start with the reason."""
    save_tiny("gpt_neox", tmp_path / "neox")
    with pytest.raises(PluginError, match="GPTNeoXForCausalLM' is not served by llmkit"):
        model_class(_config(tmp_path / "neox"), model_impl="llmkit")
    from llmkit.core.engine.config import EngineConfig
    from llmkit.core.engine.stages.plan import resolve_plan

    with pytest.raises(ValueError, match="--quantization: not available on the transformers fallback"):
        resolve_plan(EngineConfig(model_path=str(tmp_path / "neox"), device="cpu", quantization="int8"))
    # StableLM's attention does not go through transformers' attention interface
    save_tiny("stablelm", tmp_path / "stablelm")
    with pytest.raises(ValueError, match="does not route its attention through transformers' attention interface"):
        model_class(_config(tmp_path / "stablelm"))
    # DiffLlama attends twice over one layer's cache: caught by the start-up probe
    save_tiny("diffllama", tmp_path / "diff")
    with pytest.raises(ValueError, match="DiffLlamaAttention calls the attention interface twice in one layer"):
        start_engine(model_path=str(tmp_path / "diff"), device="cpu")
    # a state-space model keeps a cache the fallback does not have
    cfg = transformers.MambaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2).to_dict()
    with pytest.raises(ValueError, match="transformers fallback cannot serve it either"):
        model_class({**cfg, "architectures": ["MambaForCausalLM"]})


def test_served_through_the_openai_client(tmp_path):
    """The real server on a fallback model: completions, streaming equal to non-streaming."""
    save_tiny("gpt_neox", tmp_path)
    proc, url = start_server(["--model-path", str(tmp_path), "--max-running-requests", "4"])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        body = dict(model="m", prompt=_prompt(4, 12), max_tokens=8, temperature=0)  # ids: a 512-token vocabulary
        whole = client.completions.create(**body)
        assert 1 <= whole.usage.completion_tokens <= 8
        streamed = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True))
        assert streamed == whole.choices[0].text
    finally:
        stop_server(proc)
