"""Tree drafts (``--speculative-eagle-topk`` above 1): several candidate continuations verified in one
forward, each node computed as a decode step of its own path. The output stays the plain engine's,
greedy and seeded, batched, when the target keeps a node off the tree's main chain (whose K/V then
moves to the position it holds), and the flag is refused where trees are not drafted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from spec_utils import assert_same_outputs, generate_all_then_stop

from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.model_runner import ModelRunner
from llmkit.core.speculative.tree import DraftTree
from llmkit.plugins.speculative.ngram import NgramProposer

from model_utils import start_engine

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
PROMPTS = [
    f"<|im_start|>user\nRepeat this code exactly:\n{CODE * 2}<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nQuote and fix: 'The the cat sat on the the mat, the cat sat.'<|im_end|>\n<|im_start|>assistant\n",
]
SAMPLING = [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.95, "seed": 7}]


def test_a_trie_of_candidates_keeps_the_best_as_its_main_chain():
    tree = DraftTree.from_paths([[1, 2, 3], [1, 4], [5, 6, 7], [1, 2, 8]], max_nodes=8, max_depth=3)
    assert tree.tokens == (1, 2, 3, 5, 4, 6, 7, 8)  # the main chain, then level by level
    assert tree.parents == (-1, 0, 1, -1, 0, 3, 5, 1)
    assert tree.depths() == [1, 2, 3, 1, 2, 2, 3, 3]
    assert tree.path(7) == [0, 1, 7] and tree.path(6) == [3, 5, 6]
    assert tree.child(-1, 5) == 3 and tree.child(1, 8) == 7 and tree.child(0, 9) is None
    small = tree.truncated(max_nodes=5, max_depth=2)
    assert small.tokens == (1, 2, 5, 4, 6) and small.parents == (-1, 0, -1, 0, 2)
    assert not tree.is_chain() and DraftTree.from_paths([[1, 2]], 8, 4).is_chain()


def test_ngram_drafts_the_continuations_of_several_occurrences():
    ids = [9, 1, 2, 3, 9, 1, 2, 4, 8, 1, 2]  # "1 2" went on as "3 9" and as "4 8"
    req = SimpleNamespace(all_ids=ids, spec_state=None)
    tree = NgramProposer(min_match=2, max_match=2, topk=2).propose(req, 2)
    assert isinstance(tree, DraftTree)
    assert tree.tokens == (4, 8, 3, 9) and tree.parents == (-1, 0, -1, 2)  # the latest first
    chain = NgramProposer(min_match=2, max_match=2).propose(SimpleNamespace(all_ids=ids, spec_state=None), 2)
    assert chain == [4, 8]


@pytest.fixture(scope="module")
def reference():
    return generate_all_then_stop(start_engine(), PROMPTS, SAMPLING)[0]


@pytest.fixture
def moves(monkeypatch):
    """Counts the kept nodes off a tree's main chain (their K/V moved)."""
    seen = []
    move = ModelRunner.move_kv_column

    def counted(runner, *args):
        seen.append(args)
        return move(runner, *args)

    monkeypatch.setattr(ModelRunner, "move_kv_column", counted)
    return seen


def test_ngram_trees_leave_every_output_unchanged(reference, moves):
    engine = start_engine(
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=8,
        speculative_eagle_topk=3,
        speculative_ngram_min_match_window_size=1,
    )
    trees = []
    draft = engine.speculator.draft
    engine.speculator.draft = lambda req: trees.append(d := draft(req)) or d
    got, stats = generate_all_then_stop(engine, PROMPTS, SAMPLING)
    assert_same_outputs(got, reference)
    assert any(isinstance(t, DraftTree) for t in trees) and stats.accepted_tokens > 0


def test_a_kept_branch_off_the_main_chain_is_exact(reference, moves):
    """Every draft a tree whose main chain is wrong and whose second branch is the greedy output's
    next tokens: every step keeps the branch, so every kept token's K/V moves, and a wrong move
    would change what follows."""
    engine = start_engine(speculative_algorithm="NGRAM", speculative_num_draft_tokens=8, speculative_eagle_topk=2)
    want = {f"p{i}-s0": reference[(i, 0)][0] for i in range(len(PROMPTS))}
    vocab = engine.vocab_size

    def oracle(req, max_tokens):
        if req.rid not in want:
            return []
        nxt = want[req.rid][len(req.output_ids) : len(req.output_ids) + min(3, max_tokens)]
        if not nxt:
            return []
        wrong = [(t + 1) % vocab for t in nxt]
        return DraftTree.from_paths([wrong, nxt], max_nodes=8, max_depth=max_tokens)

    engine.speculator.proposer.propose = oracle
    got, stats = generate_all_then_stop(engine, PROMPTS, SAMPLING)
    assert_same_outputs(got, reference)
    assert len(moves) >= stats.accepted_tokens > 20  # every kept node was off the main chain


def test_tree_drafts_are_refused_where_not_drafted(monkeypatch):
    import llmkit.core.plugins
    from llmkit.core import refusals
    from llmkit.core.speculative.contract import Proposer

    for algorithm in ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3", "MTP"):
        refusals._check_speculative(EngineConfig(speculative_algorithm=algorithm, speculative_eagle_topk=2))

    class ChainOnly(Proposer):  # a third party's plugin that drafts chains
        def propose(self, req, max_tokens):
            return []

    fake = SimpleNamespace(speculative_algorithm=lambda name: ChainOnly)
    monkeypatch.setattr(llmkit.core.plugins, "registry", lambda: fake)
    with pytest.raises(ValueError, match="LOOKAHEAD drafts one chain"):
        refusals._check_speculative(EngineConfig(speculative_algorithm="LOOKAHEAD", speculative_eagle_topk=2))
    # FlashInfer reads a sequence's pages, not its slots one by one: a node's path does not fit them
    from llmkit.core.model.attention import TOKEN_SLOTS
    from llmkit.plugins.attention.flashinfer_backend import FlashInferAttentionBackend

    with pytest.raises(ValueError, match="token_slots"):
        FlashInferAttentionBackend.check_features({TOKEN_SLOTS}, "flashinfer")
