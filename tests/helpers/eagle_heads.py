"""Random EAGLE-1/2 draft heads (as their repositories ship them: a one-layer Llama config and
the weights) at the tests' tiny shapes: the tiny Llama's of ``model_utils`` and the tiny
vision-language models' of ``vl_utils`` (hidden 64, 512 tokens)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, THETA, EPS = 64, 4, 2, 16, 128, 512, 10000.0, 1e-6


def head_tensors(seed: int = 0, bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A random head; with ``bias``, one whose output is ``bias`` whatever its input (fc, o_proj
    and down_proj zero)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.zeros(*shape) if bias is not None else torch.randn(*shape, generator=g) * 0.2

    return {
        "fc.weight": w(HIDDEN, 2 * HIDDEN),
        "fc.bias": bias if bias is not None else torch.randn(HIDDEN, generator=g) * 0.2,
        "layers.0.self_attn.q_proj.weight": torch.randn(HEADS * HEAD_DIM, HIDDEN, generator=g) * 0.2,
        "layers.0.self_attn.k_proj.weight": torch.randn(KV_HEADS * HEAD_DIM, HIDDEN, generator=g) * 0.2,
        "layers.0.self_attn.v_proj.weight": torch.randn(KV_HEADS * HEAD_DIM, HIDDEN, generator=g) * 0.2,
        "layers.0.self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
        "layers.0.mlp.gate_proj.weight": torch.randn(INTER, HIDDEN, generator=g) * 0.2,
        "layers.0.mlp.up_proj.weight": torch.randn(INTER, HIDDEN, generator=g) * 0.2,
        "layers.0.mlp.down_proj.weight": w(HIDDEN, INTER),
        "layers.0.post_attention_layernorm.weight": 1 + torch.randn(HIDDEN, generator=g) * 0.1,
        "layers.0.input_layernorm.weight": torch.ones(HIDDEN),  # shipped, unused by EAGLE's first layer
    }


def save_head(path, tensors, **overrides) -> None:
    path.mkdir(parents=True, exist_ok=True)
    config = dict(
        architectures=["LlamaForCausalLM"], hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, intermediate_size=INTER, num_hidden_layers=1, rms_norm_eps=EPS,
        rope_theta=THETA, max_position_embeddings=256, vocab_size=VOCAB,
    )  # fmt: skip
    config.update(overrides)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
