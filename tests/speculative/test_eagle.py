"""``--speculative-algorithm EAGLE``: an EAGLE-1/2 draft head (fc over [embedding, feature], one
Llama layer without its input norm, the target's LM head).

- The head's drafts equal a from-scratch computation written out here, across proposals whose
  drafts were partly rejected.
- Served, a random head leaves the output unchanged (greedy and seeded); a head whose output always
  names token 0, over a target that always says 0, keeps every greedy draft.
- A head that does not fit is refused with the reason.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from eagle_heads import EPS, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, THETA, VOCAB, head_tensors, save_head
from spec_utils import serve_prompts, tp2_and_one_rank, walk_proposals

from model_utils import copy_embedded_tokenizer, load_ours, save_tiny_model, start_engine


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import transformers

    target = tmp_path_factory.mktemp("target")
    save_tiny_model("llama", target, num_hidden_layers=3)
    copy_embedded_tokenizer(target)
    head = tmp_path_factory.mktemp("head")
    save_head(head, head_tensors())
    constant = tmp_path_factory.mktemp("constant-target")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.zero_()  # every logit 0: it always says token 0
    model.save_pretrained(constant)
    copy_embedded_tokenizer(constant)
    # a head whose output is a multiple of the LM head's row 0: its logits pick token 0
    row0 = model.lm_head.weight[0].detach()
    assert int((model.lm_head.weight @ (row0 * 10)).argmax()) == 0
    agreeing = tmp_path_factory.mktemp("agreeing-head")
    save_head(agreeing, head_tensors(bias=row0 * 10))
    # a head whose first choice is another token and whose second is 0: a tree's main chain is
    # always wrong and the target keeps the branch of 0s beside it
    second = tmp_path_factory.mktemp("second-choice-head")
    save_head(second, head_tensors(bias=_second_choice_bias(model.lm_head.weight.detach())))
    return SimpleNamespace(target=target, head=head, constant=constant, agreeing=agreeing, second=second)


def _second_choice_bias(lm_head: torch.Tensor) -> torch.Tensor:
    """An output whose logits rank some token first and token 0 second, with margins."""
    for x in range(1, 64):
        for c in torch.linspace(1, 20, 96).tolist():
            bias = lm_head[0] * 10 + lm_head[x] * c
            top = (lm_head @ bias).topk(3)
            gaps = top.values[:-1] - top.values[1:]
            if top.indices[:2].tolist() == [x, 0] and bool((gaps > 0.5).all()):
                return bias
    raise AssertionError("no such bias for this LM head")


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rope(x, positions):
    inv = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    ang = positions[:, None].double() * inv[None, :]
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def reference_drafts(t, target, feats, ids, first, n, k, forced=(), logits=None) -> list[int]:
    """The k drafts after ``ids``, every row recomputed with full causal attention. ``forced``: the
    first drafts are these tokens instead of the head's picks; ``logits`` (a list) gets each step's."""
    embed = target.model.embed_tokens.weight.detach()  # (transformers' model: the weights as saved)
    lm_head = target.lm_head.weight.detach()
    norm_w = target.model.norm.weight.detach()
    hidden = [_rms(feats[p], norm_w) for p in range(first, n)]  # the target's output states
    tokens, positions, drafts = list(ids[first + 1 : n + 1]), list(range(first, n)), []
    for step in range(k):
        m = len(tokens)
        x = torch.cat((embed[torch.tensor(tokens)], torch.stack(hidden)), -1) @ t["fc.weight"].T + t["fc.bias"]
        pos = torch.tensor(positions)
        q = _rope((x @ t["layers.0.self_attn.q_proj.weight"].T).view(m, HEADS, HEAD_DIM), pos)
        kk = _rope((x @ t["layers.0.self_attn.k_proj.weight"].T).view(m, KV_HEADS, HEAD_DIM), pos)
        v = (x @ t["layers.0.self_attn.v_proj.weight"].T).view(m, KV_HEADS, HEAD_DIM)
        kk, v = kk.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) / HEAD_DIM**0.5
        scores = scores.masked_fill(torch.ones(m, m, dtype=torch.bool).triu(1), float("-inf"))
        mid = (
            torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(m, -1) @ t["layers.0.self_attn.o_proj.weight"].T
        )
        mid = mid + x
        h = _rms(mid, t["layers.0.post_attention_layernorm.weight"])
        gate, up = h @ t["layers.0.mlp.gate_proj.weight"].T, h @ t["layers.0.mlp.up_proj.weight"].T
        out = (torch.nn.functional.silu(gate) * up) @ t["layers.0.mlp.down_proj.weight"].T + mid
        row = out[-1] @ lm_head.T
        if logits is not None:
            logits.append(row)
        drafts.append(forced[step] if step < len(forced) else int(row.argmax()))
        hidden.append(out[-1])
        tokens.append(drafts[-1])
        positions.append(n + step)
    return drafts


def test_the_heads_drafts_equal_a_from_scratch_computation(models):
    import transformers

    from llmkit.plugins.speculative.eagle import EagleProposer

    target = load_ours(models.target)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(models.target), dtype=torch.float32)
    proposer = EagleProposer(draft_model_path=str(models.head), target_model=target)
    assert proposer.feature_layers == (3,)
    t = head_tensors()
    walk_proposals(
        proposer,
        lambda states, ids, first, n, k: reference_drafts(t, hf, states, ids, first, n, k),
        HIDDEN,
        VOCAB,
        first=2,
    )


def _children_follow_the_head(tree, t, hf, states, ids, first, n, k=3):
    """Every node's children (the root's too) are among the head's top k after the node's path."""
    for node in [-1, *range(len(tree))]:
        kids = {tree.tokens[i] for i in range(len(tree)) if tree.parents[i] == node}
        if not kids:
            continue
        path = [] if node < 0 else [tree.tokens[i] for i in tree.path(node)]
        logits: list = []
        reference_drafts(t, hf, states, ids, first, n, len(path) + 1, forced=path, logits=logits)
        assert kids <= set(logits[-1].topk(k).indices.tolist()), (node, path)


def test_a_tree_of_drafts_follows_the_heads_top_k_on_every_path(models):
    """Top-k 3: the tree's every node has children the from-scratch head ranks among its top 3
    after that node's path (the head ran the paths of a depth as one masked batch); then the
    target keeps a path off the main chain, and the next tree reads the kept nodes' states."""
    import transformers

    from llmkit.core.speculative.tree import DraftTree
    from llmkit.plugins.speculative.eagle import EagleProposer

    target = load_ours(models.target)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(models.target), dtype=torch.float32)
    proposer = EagleProposer(draft_model_path=str(models.head), target_model=target, topk=3)
    t = head_tensors()
    g = torch.Generator().manual_seed(9)
    ids = [int(i) for i in torch.randint(0, VOCAB, (7,), generator=g)]
    req = SimpleNamespace(all_ids=ids, num_computed=0, spec_state=None, mm=None)
    rows = torch.randn(7, HIDDEN, generator=g)
    states = {p: rows[p] for p in range(7)}
    proposer.observe(req, 0, rows)
    ids.append(11)
    req.num_computed = 7
    tree = proposer.propose(req, 3)
    assert isinstance(tree, DraftTree) and len(tree) > 3 and not tree.is_chain()
    _children_follow_the_head(tree, t, hf, states, ids, 0, 7)
    # the target computes the root and every node, and keeps the deepest path off the main chain
    rows = torch.randn(1 + len(tree), HIDDEN, generator=g)
    proposer.observe(req, 7, rows, tree)
    off = [i for i in range(len(tree)) if i not in tree.path(tree.parents.index(-1))]
    kept = tree.path(max(off, key=lambda i: len(tree.path(i))))
    states[7] = rows[0]
    for depth, node in enumerate(kept, start=1):
        states[7 + depth] = rows[1 + node]
    ids.extend([tree.tokens[i] for i in kept] + [42])
    req.num_computed = 7 + 1 + len(kept)
    again = proposer.propose(req, 3)
    assert isinstance(again, DraftTree) and len(again) > 3
    _children_follow_the_head(again, t, hf, states, ids, 0, req.num_computed)


def test_served_output_is_unchanged_and_an_agreeing_head_keeps_every_draft(models):
    reference, _ = serve_prompts(models.target, 20)
    got, stats = serve_prompts(
        models.target, 20, speculative_algorithm="EAGLE", speculative_draft_model_path=str(models.head),
        speculative_num_draft_tokens=3,
    )  # fmt: skip
    assert got == reference and stats.verify_steps > 0
    tree, stats = serve_prompts(
        models.target, 20, speculative_algorithm="EAGLE", speculative_draft_model_path=str(models.head),
        speculative_num_draft_tokens=6, speculative_eagle_topk=3,
    )  # fmt: skip
    assert tree == reference and stats.verify_steps > 0
    reference, _ = serve_prompts(models.constant, 20)
    for topk in (1, 3):
        got, stats = serve_prompts(
            models.constant, 20, speculative_algorithm="EAGLE", speculative_draft_model_path=str(models.agreeing),
            speculative_num_draft_tokens=4, speculative_eagle_topk=topk,
        )  # fmt: skip
        assert got == reference and reference[(0, 0)] == [0] * 20
        assert stats.accepted_tokens >= 3 * 12 and stats.accept_length > 1.5, topk


@pytest.mark.slow  # a server of two rank processes
def test_under_tp2_rank_0_drafts_through_the_gathered_lm_head(models):
    """``--tp-size 2``: the target's LM head is split over the ranks and only rank 0 drafts, on its
    gathered copy. Top-k 3 with a head whose first choice is never the target's: every kept node
    is off the tree's main chain, so its K/V moves, on rank 0 at once and on rank 1 with the next
    step. The output and the drafts kept are one rank's. (The constant target does not read its
    K/V: the moves' numbers are checked in-process, test_tree_drafts, and on the wire,
    test_step_wire.)"""
    spec = dict(
        speculative_algorithm="EAGLE", speculative_draft_model_path=str(models.second),
        speculative_num_draft_tokens=9, speculative_num_steps=3, speculative_eagle_topk=3,
    )  # fmt: skip
    (got, accepted), (reference, stats) = tp2_and_one_rank(models.constant, 20, **spec)
    assert got == reference and reference[(0, 0)] == [0] * 20
    assert accepted == stats.accepted_tokens >= 2 * 6  # (greedy requests: two or three a step)


def test_a_head_that_does_not_fit_is_refused(models, tmp_path):
    target = str(models.target)
    cases = {
        "missing": ({k: v for k, v in head_tensors().items() if k != "fc.bias"}, {}, "missing fc.bias"),
        "foreign": ({**head_tensors(), "midlayer.fc.weight": torch.zeros(2)}, {}, "unexpected tensor"),
        "width": (head_tensors(), {"hidden_size": 32}, "hidden size differs"),
    }
    for name, (tensors, config, message) in cases.items():
        save_head(tmp_path / name, tensors, **config)
        with pytest.raises(ValueError, match=message):
            start_engine(
                model_path=target, speculative_algorithm="EAGLE", speculative_draft_model_path=str(tmp_path / name)
            )
