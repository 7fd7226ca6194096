"""``--speculative-algorithm MTP``: DeepSeek-V3's multi-token-prediction layer drafts.

A tiny random DeepSeek-V3 (2 layers: dense, then MoE) with an MTP layer written after its last
layer as DeepSeek ships it (``model.layers.2.*``: enorm, hnorm, eh_proj, an MLA + MoE block,
shared_head):
- the layer's drafts with its K/V cache, across partly rejected proposals, equal those of a fresh
  layer fed the whole history at once;
- served, a random MTP layer leaves the output unchanged (greedy and seeded), and one that agrees
  with its target keeps every greedy draft;
- a target without an MTP layer, or of another family, is refused.
"""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from llmkit.core.engine.messages import GenerateRequest, SamplingParams

from model_utils import copy_embedded_tokenizer, load_ours, save_tiny_model, start_engine

PROMPTS = [[5, 6, 7, 8, 9] * 3, [11, 12, 13], [100, 200, 300, 400, 100, 200, 300]]
SAMPLING = [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.9, "seed": 3}]


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
    g = torch.Generator().manual_seed(5)
    feats: dict[int, torch.Tensor] = {}

    def computed(req, start, count):
        rows = torch.randn(count, config["hidden_size"], generator=g)
        for j in range(count):
            feats[start + j] = rows[j]
        cached.observe(req, start, rows)

    ids = [int(i) for i in torch.randint(0, config["vocab_size"], (6,), generator=g)]
    req = SimpleNamespace(all_ids=ids, num_computed=0, spec_state=None, mm=None)
    computed(req, 0, 6)
    ids.append(17)
    req.num_computed = 6
    for round_, keep in enumerate([1, 0, 3, 2]):
        drafts = cached.propose(req, 3)
        fresh = MTPProposer(target_model=target, target_model_path=str(models.target))
        whole = SimpleNamespace(all_ids=list(ids), num_computed=req.num_computed, spec_state=None, mm=None)
        fresh.observe(whole, 0, torch.stack([feats[p] for p in range(req.num_computed)]))
        assert drafts == fresh.propose(whole, 3), round_
        n = req.num_computed
        computed(req, n, 4)
        ids.extend(drafts[:keep])
        ids.append((drafts[keep] + 1) % config["vocab_size"] if keep < 3 else 42)
        req.num_computed = n + keep + 1


def _run(model_path, **spec) -> tuple[dict, object]:
    engine = start_engine(model_path=str(model_path), **spec)
    done, outs, finished = threading.Event(), {}, set()
    total = len(PROMPTS) * len(SAMPLING)

    def sink_for(key):
        def sink(o):
            outs.setdefault(key, []).extend(o.token_ids)
            if o.finished:
                finished.add(key)
                if len(finished) == total:
                    done.set()

        return sink

    try:
        for i, ids in enumerate(PROMPTS):
            for j, kw in enumerate(SAMPLING):
                params = SamplingParams(max_new_tokens=20, ignore_eos=True, **kw)
                engine.submit(GenerateRequest(f"p{i}-s{j}", ids, params), sink_for((i, j)))
        assert done.wait(300)
        return outs, engine.speculator.stats if engine.speculator else None
    finally:
        engine.shutdown()


def test_a_random_mtp_layer_leaves_the_output_unchanged(models):
    reference, _ = _run(models.target)
    got, stats = _run(models.target, speculative_algorithm="MTP", speculative_num_draft_tokens=3)
    assert got == reference
    assert stats.verify_steps > 0


def test_an_mtp_layer_that_agrees_with_its_target_keeps_every_draft(models):
    reference, _ = _run(models.constant)
    got, stats = _run(models.constant, speculative_algorithm="MTP", speculative_num_draft_tokens=4)
    assert got == reference
    assert reference[(0, 0)] == [0] * 20
    assert stats.accepted_tokens >= 3 * 12 and stats.accept_length > 1.5


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
