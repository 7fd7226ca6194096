"""``--speculative-algorithm MTP``: DeepSeek-V3's multi-token-prediction layer drafts.

A tiny random DeepSeek-V3 (2 layers: dense, then MoE) with an MTP layer written after its last
layer as DeepSeek ships it (``model.layers.2.*``: enorm, hnorm, eh_proj, an MLA + MoE block,
shared_head):
- the layer's drafts with its K/V cache, across partly rejected proposals, equal those of a fresh
  layer fed the whole history at once;
- an FP8 checkpoint's MTP layer (block-scaled, as DeepSeek ships it) loads as its dequantized
  values;
- served, a random MTP layer leaves the output unchanged (greedy and seeded), and one that agrees
  with its target keeps every greedy draft;
- a target without an MTP layer, or of another family, is refused.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from spec_utils import serve_prompts, tp2_and_one_rank, walk_proposals

from model_utils import copy_embedded_tokenizer, load_ours, save_tiny_model, start_engine


def add_mtp_layer(path, seed: int = 0, zero_head: bool = False) -> None:
    """Layer 2 of the checkpoint at ``path``: layer 1's tensors re-drawn, plus MTP's own."""
    g = torch.Generator().manual_seed(seed)
    config = json.loads((path / "config.json").read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                t = fh.get_tensor(name)
                if name.startswith("model.layers.1."):
                    new = (
                        torch.randn(t.shape, generator=g) * 0.2
                        if t.dim() > 1
                        else 1 + torch.randn(t.shape, generator=g) * 0.1
                    )
                    tensors["model.layers.2." + name[len("model.layers.1.") :]] = new.to(t.dtype)
                elif name == "model.embed_tokens.weight":
                    tensors["model.layers.2.embed_tokens.weight"] = t.clone()
    tensors["model.layers.2.enorm.weight"] = 1 + torch.randn(hidden, generator=g) * 0.1
    tensors["model.layers.2.hnorm.weight"] = 1 + torch.randn(hidden, generator=g) * 0.1
    tensors["model.layers.2.eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.2
    tensors["model.layers.2.shared_head.norm.weight"] = 1 + torch.randn(hidden, generator=g) * 0.1
    head = torch.zeros(vocab, hidden) if zero_head else torch.randn(vocab, hidden, generator=g) * 0.2
    tensors["model.layers.2.shared_head.head.weight"] = head
    save_file(tensors, str(path / "model-mtp.safetensors"))
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import transformers

    target = tmp_path_factory.mktemp("deepseek")
    save_tiny_model("deepseek_v3", target)
    plain = tmp_path_factory.mktemp("deepseek-no-mtp")
    save_tiny_model("deepseek_v3", plain)
    copy_embedded_tokenizer(plain)
    copy_embedded_tokenizer(target)
    # the same target, final norm zeroed (it always says token 0), with an MTP head that always says 0
    constant = tmp_path_factory.mktemp("deepseek-constant")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    model.save_pretrained(constant)
    copy_embedded_tokenizer(constant)
    add_mtp_layer(target)
    add_mtp_layer(constant, zero_head=True)
    return SimpleNamespace(target=target, plain=plain, constant=constant)


def test_cached_drafts_equal_a_fresh_layers(models):
    from llmkit.plugins.speculative.mtp import MTPProposer

    target = load_ours(models.target)
    config = json.loads((models.target / "config.json").read_text())
    cached = MTPProposer(target_model=target, target_model_path=str(models.target))
    assert cached.feature_layers == (2,)

    def fresh(states, ids, first, n, k):  # a new layer fed the whole history at once
        other = MTPProposer(target_model=target, target_model_path=str(models.target))
        whole = SimpleNamespace(all_ids=list(ids), num_computed=n, spec_state=None, mm=None)
        other.observe(whole, first, torch.stack([states[p] for p in range(first, n)]))
        return other.propose(whole, k)

    walk_proposals(cached, fresh, config["hidden_size"], config["vocab_size"], prompt_len=6)


def test_an_fp8_mtp_layer_loads_as_its_dequantized_values(models, tmp_path):
    """DeepSeek's own checkpoints ship the MTP layer's projections (and experts) in float8_e4m3fn
    with a scale per block: loaded, its parameters equal those of the same layer saved with the
    dequantized values, and it drafts the same."""
    import shutil

    from safetensors.torch import load_file

    from llmkit.plugins.speculative.mtp import MTPProposer

    block = 8
    fp8_dir, plain_dir = tmp_path / "fp8", tmp_path / "dequantized"
    shutil.copytree(models.target, fp8_dir)
    shutil.copytree(models.target, plain_dir)
    tensors = load_file(str(models.target / "model-mtp.safetensors"))
    quantized, dequantized = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if w.dim() != 2 or not name.endswith("proj.weight"):
            continue
        rows, cols = w.shape
        pad = torch.zeros(-(-rows // block) * block, -(-cols // block) * block)
        pad[:rows, :cols] = w.abs()
        scale = pad.view(-(-rows // block), block, -1, block).amax(dim=(1, 3)).clamp(min=1e-8) / 448
        full = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
        fp8 = (w / full).to(torch.float8_e4m3fn)
        quantized[name], quantized[name + "_scale_inv"] = fp8, scale
        dequantized[name] = fp8.float() * full
    assert sum(t.dtype == torch.float8_e4m3fn for t in quantized.values()) > 10
    save_file(quantized, str(fp8_dir / "model-mtp.safetensors"))
    save_file(dequantized, str(plain_dir / "model-mtp.safetensors"))
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block]}
    (fp8_dir / "config.json").write_text(json.dumps(config))

    target = load_ours(models.target)
    got = MTPProposer(target_model=target, target_model_path=str(fp8_dir))
    want = MTPProposer(target_model=target, target_model_path=str(plain_dir))
    got_state, want_state = got.layer.state_dict(), want.layer.state_dict()
    assert got_state.keys() == want_state.keys()
    for name, value in want_state.items():
        assert torch.equal(got_state[name], value), name

    def same(states, ids, first, n, k):  # the dequantized layer fed the same history
        fresh = MTPProposer(target_model=target, target_model_path=str(plain_dir))
        whole = SimpleNamespace(all_ids=list(ids), num_computed=n, spec_state=None, mm=None)
        fresh.observe(whole, first, torch.stack([states[p] for p in range(first, n)]))
        return fresh.propose(whole, k)

    walk_proposals(got, same, config["hidden_size"], config["vocab_size"], prompt_len=6)


@pytest.mark.parametrize("topk", [1, 3])
def test_a_random_mtp_layer_leaves_the_output_unchanged(models, topk):
    reference, _ = serve_prompts(models.target, 20)
    got, stats = serve_prompts(
        models.target,
        20,
        speculative_algorithm="MTP",
        speculative_num_draft_tokens=3 * topk,
        speculative_eagle_topk=topk,
    )
    assert got == reference  # a chain or a tree (its latent attention masked per path)
    assert stats.verify_steps > 0


def test_an_mtp_layer_that_agrees_with_its_target_keeps_every_draft(models):
    reference, _ = serve_prompts(models.constant, 20)
    got, stats = serve_prompts(models.constant, 20, speculative_algorithm="MTP", speculative_num_draft_tokens=4)
    assert got == reference
    assert reference[(0, 0)] == [0] * 20
    assert stats.accepted_tokens >= 3 * 12 and stats.accept_length > 1.5


@pytest.mark.slow  # a server of two rank processes
def test_under_tp2_rank_0_drafts_with_the_whole_layer(models):
    """``--tp-size 2``: the target's layers and embedding are split over the ranks; rank 0 holds
    the MTP layer whole and a gathered copy of the embedding (test_target_vocab.py checks the
    copy), and drafts alone. The agreeing layer's drafts are kept as on one rank, and the output
    is one rank's, greedy and seeded."""
    spec = dict(speculative_algorithm="MTP", speculative_num_draft_tokens=4)
    (got, accepted), (reference, stats) = tp2_and_one_rank(models.constant, 20, **spec)
    assert got == reference and reference[(0, 0)] == [0] * 20
    assert accepted == stats.accepted_tokens >= 3 * 12


def test_targets_without_an_mtp_layer_are_refused(models, tiny_llama):
    # its config names one, its checkpoint has none
    with pytest.raises(ValueError, match="is missing eh_proj.weight, enorm.weight"):
        start_engine(model_path=str(models.plain), speculative_algorithm="MTP")
    config_path = models.plain / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="no multi-token-prediction layer"):
        start_engine(model_path=str(models.plain), speculative_algorithm="MTP")
    with pytest.raises(ValueError, match="DeepSeek-V3/R1-style target"):
        start_engine(model_path=str(tiny_llama), speculative_algorithm="MTP")
