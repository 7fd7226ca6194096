"""``--speculative-algorithm STANDALONE``: a draft model proposes, the target's output is unchanged.

Tiny random Llamas: the target itself as its own draft (every draft token must then be kept, which
only holds if the draft's own K/V cache is right), and the target with noise added to its weights
(a draft that is mostly right: some drafts kept, some cut off and the cache re-synced).
"""

from __future__ import annotations

import pytest
import torch
from spec_utils import serve_prompts

from model_utils import copy_embedded_tokenizer, save_tiny_model, start_engine


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import transformers

    target = tmp_path_factory.mktemp("target")
    save_tiny_model("llama", target)
    copy_embedded_tokenizer(target)
    noisy = tmp_path_factory.mktemp("noisy-draft")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.add_(torch.randn_like(p) * 0.03)
    model.save_pretrained(noisy)
    return target, noisy


@pytest.fixture(scope="module")
def reference(models):
    return serve_prompts(models[0])[0]


def test_the_target_as_its_own_draft_keeps_every_draft_token(models, reference):
    target, _ = models
    got, stats = serve_prompts(
        target,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(target),
        speculative_num_draft_tokens=3,
    )
    assert got == reference
    assert stats.accept_length > 2.0  # of 4 at most: greedy rows keep every draft, seeded ones may not


def test_sglangs_eagle_flags_set_the_chain_or_the_tree(models, reference):
    """``--speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 3``, as
    SGLang takes them: two draft tokens a step (the draft agrees, so every verify step has both);
    with a top-k above 1 a tree (the target as its own draft: its main chain is kept)."""
    target, _ = models
    spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=str(target))
    got, stats = serve_prompts(
        target, speculative_num_steps=2, speculative_eagle_topk=1, speculative_num_draft_tokens=3, **spec
    )
    assert got == reference
    assert stats.verify_steps > 0 and stats.draft_tokens <= 2 * stats.verify_steps
    assert stats.draft_tokens > 1.5 * stats.verify_steps  # mostly two: not one, not three
    got, stats = serve_prompts(
        target, speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8, **spec
    )
    assert got == reference
    assert stats.draft_tokens > 3 * stats.verify_steps and stats.accept_length > 2.0  # trees, mostly kept
    for bad in (dict(speculative_eagle_topk=0), dict(speculative_num_steps=0)):
        with pytest.raises(ValueError, match="must be at least 1"):
            _check(model_path=str(target), **bad, **spec)


@pytest.mark.parametrize("topk", [1, 3])
def test_a_noisy_draft_leaves_the_output_unchanged(models, reference, topk):
    target, noisy = models
    got, stats = serve_prompts(
        target,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(noisy),
        speculative_num_draft_tokens=4 * topk,
        speculative_num_steps=4,
        speculative_eagle_topk=topk,
    )
    assert got == reference  # greedy and seeded alike, a chain or a tree
    assert 0 < stats.accepted_tokens < stats.draft_tokens  # kept and cut off: the cache re-syncs


def test_a_draft_model_that_cannot_serve_is_refused(models, tmp_path):
    target, _ = models
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        start_engine(model_path=str(target), speculative_algorithm="STANDALONE")
    with pytest.raises(ValueError, match="no config.json"):
        start_engine(
            model_path=str(target), speculative_algorithm="STANDALONE", speculative_draft_model_path=str(tmp_path)
        )
    small = tmp_path / "small-vocab"
    save_tiny_model("llama", small, vocab_size=256)
    with pytest.raises(ValueError, match="vocabulary"):
        start_engine(
            model_path=str(target), speculative_algorithm="STANDALONE", speculative_draft_model_path=str(small)
        )


def test_the_draft_model_runs_where_it_is_told(models, reference):
    """``--speculative-draft-device cpu`` (a draft model beside a GPU target, leaving the GPU's
    memory to the target): the same output; a device that cannot be, or an algorithm that reads the
    target's tensors, is refused at start."""
    target, _ = models
    spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=str(target))
    got, stats = serve_prompts(target, speculative_draft_device="cpu", speculative_num_draft_tokens=3, **spec)
    assert got == reference and stats.accept_length > 2.0
    with pytest.raises(ValueError, match="use cpu, cuda or cuda:N"):
        _check(model_path=str(target), speculative_draft_device="tpu:0", **spec)
    with pytest.raises(ValueError, match="NGRAM has none of its own"):
        _check(model_path=str(target), speculative_algorithm="NGRAM", speculative_draft_device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            _check(model_path=str(target), speculative_draft_device="cuda", **spec)


def _check(**engine):
    """What llmkit serve and build_server refuse before loading (core/refusals.py)."""
    from llmkit.core.engine.config import EngineConfig
    from llmkit.core.refusals import check_configs
    from llmkit.core.server.config import ServerConfig

    check_configs(EngineConfig(**engine), ServerConfig())


def test_a_tree_follows_the_draft_models_top_k_on_every_path(models):
    """Top-k 3: every node's children are among the draft model's top 3 after the node's path
    (transformers over the whole sequence), though the search ran each depth's paths as one batch
    over the draft's own K/V; a second tree, after the target kept a path off the main chain, too."""
    from types import SimpleNamespace

    import transformers

    from llmkit.core.speculative.tree import DraftTree
    from llmkit.plugins.speculative.standalone import StandaloneProposer

    _, noisy = models
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(noisy), dtype=torch.float32).eval()
    proposer = StandaloneProposer(draft_model_path=str(noisy), topk=3)
    ids = [(13 * i + 7) % 500 + 3 for i in range(9)]
    req = SimpleNamespace(all_ids=ids, spec_state=None, mm=None)

    def check(tree):
        assert isinstance(tree, DraftTree) and len(tree) > 3 and not tree.is_chain()
        for node in [-1, *range(len(tree))]:
            kids = {tree.tokens[i] for i in range(len(tree)) if tree.parents[i] == node}
            if kids:
                path = [] if node < 0 else [tree.tokens[i] for i in tree.path(node)]
                with torch.no_grad():
                    logits = hf(torch.tensor([ids + path])).logits[0, -1]
                assert kids <= set(logits.topk(3).indices.tolist()), (node, path)

    tree = proposer.propose(req, 3)
    check(tree)
    main = tree.path(tree.parents.index(-1))
    off = max((i for i in range(len(tree)) if i not in main), key=lambda i: len(tree.path(i)))
    ids.extend([tree.tokens[i] for i in tree.path(off)] + [42])
    check(proposer.propose(req, 3))
