"""LFM2: gated short convolutions (their state the convolution's last inputs, no recurrent matrix)
beside grouped-query attention, through the same state pool and state-aware prefix cache as the
Qwen hybrids. The conv kernel against transformers'; the real engine's greedy output against
transformers' ``generate`` (prompts batched, chunked, a conversation resumed from a snapshot); a
GGUF written the way llama.cpp's converter writes one, loaded and compared logit for logit; a
layer table that disagrees with the weights fails naming the layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hybrid_utils import (
    check_batched,
    check_conversation,
    check_one_token_prompt,
    prompt,
    served_engine,
)

from llmkit.core.model.hybrid import causal_conv

from model_utils import save_tiny_model


def test_short_conv_prefill_then_steps_match_one_pass():
    """Without the SiLU, with a bias: a sequence's convolution in two chunks and then token by
    token, carrying the state, equals transformers' one pass (causal_conv1d_fn, no activation)."""
    from transformers.models.lfm2.modeling_lfm2 import causal_conv1d_fn

    torch.manual_seed(0)
    T, C, K = 17, 8, 3
    x, w, b = torch.randn(T, C), torch.randn(C, K), torch.randn(C)
    ref = causal_conv1d_fn(x.t()[None], w, b, activation=None)[0].t()
    a, state = causal_conv.conv_prefill(x[:2], w, None, b, silu=False)  # (shorter than the kernel)
    c, state = causal_conv.conv_prefill(x[2:12], w, state, b, silu=False)
    rows, state = [a, c], state[None]
    for t in range(12, T):
        o, state = causal_conv.conv_step(x[t : t + 1], w, state, b, silu=False)
        rows.append(o)
    torch.testing.assert_close(torch.cat(rows), ref, atol=1e-6, rtol=1e-6)


# --- the engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """transformers' model and an engine on its checkpoint (hybrid_utils.served_engine)."""
    ref, engine = served_engine("lfm2", tmp_path_factory.mktemp("lfm2"))
    yield ref, engine
    engine.shutdown()


def test_greedy_matches_generate_batched(served):
    check_batched(*served)


def test_conversation_resumes_from_snapshot(served):
    check_conversation(*served)


def test_one_token_prompt_starts_from_zeros_on_a_used_row(served):
    check_one_token_prompt(*served)


# --- loading --------------------------------------------------------------------------------


def test_layer_table_disagreeing_with_weights_names_the_layer(tmp_path):
    """A config whose layer 1 says attention over a checkpoint whose layer 1 is a convolution."""
    from llmkit.core.engine.builder import build_model
    from llmkit.core.model.loader.source import iter_safetensors
    from llmkit.plugins.models.lfm2 import Lfm2ForCausalLM

    ref = save_tiny_model("lfm2", tmp_path)
    config = ref.config.to_dict()
    config["layer_types"] = ["conv", "full_attention", "full_attention", "conv", "full_attention"]
    model = build_model(Lfm2ForCausalLM, config, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="layer 1 is 'full_attention'.*'conv' weight"):
        model.load_weights(iter_safetensors(tmp_path))


def test_feed_forward_width_as_transformers():
    """The adjusted width: rounded only with a multiplier (as transformers' Lfm2MLP), the
    ``block_ff_dim`` alias winning, no adjustment when turned off."""
    from llmkit.plugins.models.lfm2 import feed_forward_width

    base = dict(block_ff_dim=12288, block_multiple_of=256, block_ffn_dim_multiplier=1.0)
    assert feed_forward_width(base) == 8192  # LFM2-1.2B
    assert feed_forward_width({**base, "intermediate_size": 99}) == 8192
    assert feed_forward_width({**base, "block_ffn_dim_multiplier": None, "block_ff_dim": 100}) == 66
    assert feed_forward_width({**base, "block_auto_adjust_ff_dim": False}) == 12288


# --- GGUF -----------------------------------------------------------------------------------

_GGUF_NAMES = {
    "operator_norm": "attn_norm",
    "ffn_norm": "ffn_norm",
    "feed_forward.w1": "ffn_gate",
    "feed_forward.w3": "ffn_up",
    "feed_forward.w2": "ffn_down",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_output",
    "self_attn.q_layernorm": "attn_q_norm",
    "self_attn.k_layernorm": "attn_k_norm",
    "conv.in_proj": "shortconv.in_proj",
    "conv.out_proj": "shortconv.out_proj",
}


def _write_gguf(ref, path) -> None:
    """As llama.cpp's converter: KV heads per layer (0 for a convolution), the adjusted
    feed-forward width, the final norm as ``token_embd_norm``, the conv weight squeezed to
    ``[C, L]``, no ``output`` tensor for tied embeddings."""
    gguf = pytest.importorskip("gguf")
    cfg = ref.config
    w = gguf.GGUFWriter(str(path), "lfm2")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(ref.model.layers[0].feed_forward.w1.weight.shape[0])
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([cfg.num_key_value_heads if t != "conv" else 0 for t in cfg.layer_types])
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_shortconv_l_cache(cfg.conv_L_cache)
    sd = {k: v.detach().float().numpy() for k, v in ref.state_dict().items()}

    def add(name, t):
        w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("token_embd_norm.weight", sd["model.embedding_norm.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf, g in _GGUF_NAMES.items():
            if p + hf + ".weight" in sd:
                add(f"blk.{i}.{g}.weight", sd[p + hf + ".weight"])
        if p + "conv.conv.weight" in sd:
            add(f"blk.{i}.shortconv.conv.weight", sd[p + "conv.conv.weight"].squeeze(1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_matches_transformers(tmp_path):
    """The GGUF's config names the same layers and width; its prefill (in two chunks) and decode
    logits equal transformers' on the same weights."""
    gguf = pytest.importorskip("gguf")
    from llmkit.core.engine.builder import build_model
    from llmkit.core.model import quantize
    from llmkit.core.model.loader.gguf_loader import gguf_config, gguf_tensors
    from llmkit.core.plugins import registry

    from paged_runner import PagedRunner

    ref = save_tiny_model("lfm2", tmp_path / "hf")
    _write_gguf(ref, tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    config = gguf_config(reader)
    assert config["layer_types"] == list(ref.config.layer_types) and config["tie_word_embeddings"]
    model_cls = registry().model(registry().architecture_for_model_type(config["model_type"]))
    model = build_model(model_cls, config, torch.device("cpu"), torch.float32)
    assert model.config["intermediate_size"] == ref.model.layers[0].feed_forward.w1.weight.shape[0]
    model.load_weights(gguf_tensors(reader, config))
    quantize.finalize_weights(model)
    ids = prompt(7, 30)
    runner = PagedRunner(model, 4)
    row = runner.new_seq()
    (head,) = runner.step([(row, ids[:13])])
    (tail,) = runner.step([(row, ids[13:])])
    (decode,) = runner.step([(row, [7])])
    with torch.no_grad():
        logits = ref(torch.tensor([ids + [7]])).logits[0]
    torch.testing.assert_close(torch.cat([head, tail]), logits[:-1], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(decode[0], logits[-1], atol=2e-4, rtol=2e-4)
