"""Build llmkit models outside a server (for comparisons against transformers)."""

from __future__ import annotations

import torch

from llmkit.core.engine.builder import build_engine_parts
from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.loop import Engine


def tiny_config(arch: str, **overrides):
    import transformers

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "llama":
        return transformers.LlamaConfig(**common, rope_theta=10000.0)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=1000000.0)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)
    if arch == "qwen3_moe":
        # layer 0 sparse, layer 1 dense (mlp_only_layers); 4 experts, top-2, renormalised
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
        moe.update(decoder_sparse_step=1, mlp_only_layers=[1])
        return transformers.Qwen3MoeConfig(**{**common, **moe, **overrides}, head_dim=32, rope_theta=1000000.0)
    raise ValueError(arch)


def save_tiny_model(arch: str, path, **overrides) -> "torch.nn.Module":
    """A random-weight HF model saved as safetensors, with the embedded model's tokenizer files."""
    import transformers

    torch.manual_seed(0)
    cfg = tiny_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; widen it so logits differ meaningfully
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    # small shards: loading must walk a sharded checkpoint
    model.save_pretrained(str(path), safe_serialization=True, max_shard_size="200KB")
    return model.eval()


def copy_embedded_tokenizer(path) -> None:
    """The embedded model's tokenizer files into ``path``, so a saved tiny model can be served."""
    import shutil
    from pathlib import Path

    from llmkit.core.model.source import resolve_model_dir

    for f in resolve_model_dir(None).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, Path(path) / f.name)


def start_engine(**kwargs) -> Engine:
    kwargs.setdefault("grammar_backend", "none")  # no compiler workers unless a test needs them
    cfg = EngineConfig(**kwargs)
    engine = Engine(cfg, build_engine_parts(cfg))
    engine.start()
    return engine
