"""DeepSeek-V3 (MLA + DeepSeek MoE; and GLM-4.7-Flash, built on it) against transformers on tiny random-weight models: the latent
KV cache (one kv_lora_rank + qk_rope_head_dim vector per token and layer, no V), absorbed-form
attention in prefill, over a page-shared prefix, in chunks and in batched decode; YaRN with its
softmax mscale; grouped sigmoid routing with the correction bias and shared experts; greedy
generation through the engine; configs refused at start-up naming the field."""

from __future__ import annotations

import pytest
import torch

from llmkit.core.model.moe import grouped_topk

from model_utils import assert_greedy_matches_generate, copy_embedded_tokenizer, load_ours, save_tiny_model
from paged_runner import PagedRunner, check_cached_prefix_chunked_decode, mixed_scenario, mixed_scenario_interpreted
from paged_runner import assert_close as _close

YARN = dict(
    rope_type="yarn",
    factor=40.0,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=1.0,
    original_max_position_embeddings=32,  # small, so the scaled frequencies matter in a short prompt
    rope_theta=10000.0,
)
VARIANTS = {
    "v3": ("deepseek_v3", {}),
    # no q LoRA (V2-Lite's layout), YaRN as V3 ships it, plain (non-interleaved) rope
    "v3-yarn-no-q-lora": ("deepseek_v3", dict(q_lora_rank=None, rope_parameters=YARN, rope_interleave=False)),
    # DeepseekV2ForCausalLM: V2-Lite's layout, group-limited softmax routing; then V2's q LoRA, greedy
    "v2-lite": ("deepseek_v2", {}),
    "v2-greedy-yarn": ("deepseek_v2", dict(q_lora_rank=24, topk_method="greedy", rope_parameters=YARN)),
    # Glm4MoeLiteForCausalLM (GLM-4.7-Flash): value heads of 32 against 16 no-rope query channels
    "glm-4.7-flash": ("glm4_moe_lite", {}),
}
IDS = [(37 * i + 11) % 512 for i in range(52)]


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    arch, overrides = VARIANTS[request.param]
    d = tmp_path_factory.mktemp(f"deepseek-{request.param}")
    ref = save_tiny_model(arch, d, **overrides)
    with torch.no_grad():
        full = ref(torch.tensor([IDS])).logits[0]
    return d, ref, full


def test_cache_holds_only_the_latent(tiny):
    d, _, _ = tiny
    model = load_ours(d)
    runner = PagedRunner(model, 16)
    assert model.kv_cache_dims == (16 + 8, 0)  # kv_lora_rank + qk_rope_head_dim, no values
    assert runner.pool.k_buffers[0].shape[1:] == (1, 24) and runner.pool.v_buffers == []
    assert runner.pool.bytes_per_token() == 2 * 24 * 4  # 2 layers x 24 fp32 numbers
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["MLP", "MoE"]


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_logits_match_transformers(tiny, page_size):
    d, _, full = tiny
    runner = PagedRunner(load_ours(d), page_size)
    (ours,) = runner.step([(runner.new_seq(), IDS)])
    _close(ours, full)


@pytest.mark.parametrize("page_size", [1, 16])
def test_cached_prefix_chunked_prefill_and_decode_match_transformers(tiny, page_size):
    """A 32-token prefix's latents shared page-wise, the rest prefilled in chunks batched with the
    other sequence's decode steps, then batched decode over the latent cache."""
    d, ref, _ = tiny
    check_cached_prefix_chunked_decode(load_ours(d), ref, IDS, page_size)


def test_grouped_topk_matches_transformers_router():
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(3)
    cfg = transformers.DeepseekV3Config(
        hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5
    )
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(0, 0.5)
    x = torch.randn(37, 16)
    with torch.no_grad():
        _, w_ref, ids_ref = router(x)
    w, ids = grouped_topk(
        x @ router.weight.T,
        4,
        n_group=4,
        topk_group=2,
        renormalize=True,
        correction_bias=router.e_score_correction_bias,
        scale=2.5,
    )
    order, order_ref = ids.sort(dim=-1), ids_ref.sort(dim=-1)
    assert torch.equal(order.values, order_ref.values)
    torch.testing.assert_close(w.gather(1, order.indices), w_ref.gather(1, order_ref.indices))


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_v2_softmax_routing_matches_transformers_router(method):
    import transformers
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    torch.manual_seed(4)
    cfg = transformers.DeepseekV2Config(
        hidden_size=16,
        num_attention_heads=4,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        topk_method=method,
    )
    cfg.routed_scaling_factor = 1.5
    router = DeepseekV2TopkRouter(cfg)
    with torch.no_grad():
        router.weight.normal_()
    x = torch.randn(41, 16)
    with torch.no_grad():
        _, w_ref, ids_ref = router(x)
    grouped = method != "greedy"
    w, ids = grouped_topk(
        x @ router.weight.T,
        3,
        n_group=4 if grouped else 1,
        topk_group=2 if grouped else 1,
        renormalize=False,
        scale=1.5,
        scoring="softmax",
    )
    order, order_ref = ids.sort(dim=-1), ids_ref.sort(dim=-1)
    assert torch.equal(order.values, order_ref.values)
    torch.testing.assert_close(w.gather(1, order.indices), w_ref.gather(1, order_ref.indices))


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe_lite"])
def test_greedy_32_tokens_equal_transformers_generate(tmp_path, arch):
    ref = save_tiny_model(arch, tmp_path)
    copy_embedded_tokenizer(tmp_path)
    cached = assert_greedy_matches_generate(ref, tmp_path, [IDS[:40], IDS[:32] + [401, 7, 99, 250, 3]])
    assert cached == [0, 32]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(kv_lora_rank=None), "kv_lora_rank is missing"),
        (dict(quantization_config={"quant_method": "fp8"}), r"quantization_config\.weight_block_size is missing"),
        (dict(quantization_config={"quant_method": "awq"}), r"quantization_config\.quant_method 'awq'"),
        (dict(topk_method="group_limited_greedy"), "topk_method 'group_limited_greedy'"),
        (dict(scoring_func="softmax"), "scoring_func 'softmax'"),
    ],
)
def test_unsupported_variants_are_refused_naming_the_field(tmp_path, change, message):
    from llmkit.core.engine.builder import build_model
    from llmkit.core.model.loader.source import load_config
    from llmkit.core.plugins import registry

    save_tiny_model("deepseek_v3", tmp_path)
    config = {**load_config(tmp_path), **change}
    with pytest.raises(ValueError, match=message):
        build_model(registry().model("DeepseekV3ForCausalLM"), config, torch.device("cpu"), torch.float32)


def test_fp8_block_checkpoint_loads_and_matches(tmp_path, caplog):
    """DeepSeek's own checkpoints: projection and expert weights in float8_e4m3fn with a
    weight_scale_inv per 128x128 block (here 8x8 blocks, ragged at the edges); embeddings, norms and
    the router stay unquantized. Loaded weights are dequantized; logits equal transformers' with the
    same dequantized values."""
    import json
    import logging

    from safetensors.torch import load_file, save_file

    block = (8, 8)
    ref = save_tiny_model("deepseek_v3", tmp_path)
    tensors = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
        f.unlink()
    params = dict(ref.named_parameters())
    quantized = 0
    for name in [n for n, t in tensors.items() if t.dim() == 2 and n.endswith("proj.weight")]:
        w = tensors[name]
        rows, cols = w.shape
        # one scale per block, from the block's largest magnitude (e4m3's max is 448)
        pad = torch.zeros(-(-rows // 8) * 8, -(-cols // 8) * 8)
        pad[:rows, :cols] = w.abs()
        scale = pad.view(-(-rows // 8), 8, -1, 8).amax(dim=(1, 3)).clamp(min=1e-8) / 448
        full_scale = scale.repeat_interleave(8, 0)[:rows].repeat_interleave(8, 1)[:, :cols]
        fp8 = (w / full_scale).to(torch.float8_e4m3fn)
        tensors[name], tensors[name + "_scale_inv"] = fp8, scale
        quantized += 1
        with torch.no_grad():  # the reference runs the dequantized values
            deq = fp8.float() * full_scale
            if name in params:
                params[name].copy_(deq)
            else:  # a per-expert tensor: transformers holds the experts stacked
                parts = name.split(".")
                layer, e, proj = int(parts[2]), int(parts[5]), parts[6]
                experts = ref.model.layers[layer].mlp.experts
                inter = experts.gate_up_proj.shape[1] // 2
                if proj == "gate_proj":
                    experts.gate_up_proj[e, :inter] = deq
                elif proj == "up_proj":
                    experts.gate_up_proj[e, inter:] = deq
                else:
                    experts.down_proj[e] = deq
    assert quantized > 20
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.INFO, logger="llmkit"):
        model = load_ours(tmp_path)
    assert f"{quantized} block-scaled FP8 weights dequantized" in caplog.text
    with torch.no_grad():
        full = ref(torch.tensor([IDS])).logits[0]
    runner = PagedRunner(model, 16)
    (ours,) = runner.step([(runner.new_seq(), IDS)])
    _close(ours, full)


def test_triton_kernels_interpreted_match_torch_and_transformers(tiny, tmp_path):
    """Each variant on the triton attention backend (latent KV: MQA over the cached latent, values
    its first kv_lora_rank channels) and the fused-MoE kernel, in Triton's interpreter: a cached
    prefix, chunked prefill beside decode (extend kernel), decode (split-K kernel) equal the torch
    paths and transformers."""
    d, _, full = tiny
    got = mixed_scenario_interpreted(d, 16, IDS, tmp_path / "triton.pt")
    want = mixed_scenario(d, 16, IDS)
    assert len(got) == len(want) == 11
    _close(got[0], full[:32])  # the prefill, against transformers
    _close(got[-2], full[50:51])  # the second sequence's last decode step
    for g, w in zip(got, want):
        _close(g, w)
