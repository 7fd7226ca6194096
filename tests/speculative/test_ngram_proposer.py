"""NGRAM's lookup: the draft is what followed the latest earlier occurrence of the sequence's
last tokens, the longest match first, never the sequence's own end."""

from __future__ import annotations

from llmkit.core.engine.messages import SamplingParams
from llmkit.core.engine.request import Request
from llmkit.core.speculative.speculator import Speculator
from llmkit.plugins.speculative.ngram import NgramProposer


def _req(ids, out=(), max_new=100):
    r = Request("r", list(ids), SamplingParams(max_new_tokens=max_new))
    r.output_ids = list(out)
    return r


def test_the_latest_occurrence_of_the_longest_match_is_continued():
    p = NgramProposer(min_match=1, max_match=3)
    # "7 8" occurs twice; the later one (followed by 5 6) wins; the 3-gram "9 7 8" once (followed by 1 2)
    assert p.propose(_req([7, 8, 3, 4, 7, 8, 5, 6, 9, 7, 8]), 2) == [5, 6]
    assert p.propose(_req([9, 7, 8, 1, 2, 7, 8, 5, 6, 9, 7, 8]), 2) == [1, 2]


def test_no_match_no_draft_and_the_end_never_matches_itself():
    p = NgramProposer(min_match=2, max_match=4)
    assert p.propose(_req([1, 2, 3, 4, 5]), 4) == []
    assert p.propose(_req([1, 2]), 4) == []


def test_the_index_grows_with_the_output():
    p = NgramProposer(min_match=2, max_match=2)
    r = _req([10, 11, 12, 13])
    assert p.propose(r, 3) == []
    r.output_ids += [10, 11]  # now ends with "10 11", seen at the start
    assert p.propose(r, 3) == [12, 13, 10]


def test_drafts_stay_within_max_tokens_and_back_off_after_misses():
    spec = Speculator("NGRAM", NgramProposer(min_match=1, max_match=2), num_draft_tokens=8, max_context=1000)
    r = _req([1, 2, 3, 1, 2, 3, 1, 2], out=[3], max_new=4)
    assert len(spec.draft(r)) == 2  # 4 tokens allowed, 1 out: 2 drafts + the target's own token
    for _ in range(2):
        spec.record(r, 2, 0)
    assert spec.draft(r) == [] and spec.draft(r) == []  # two misses in a row: two steps without
    assert spec.draft(r)
    spec.record(r, 2, 2)
    assert spec.stats.verify_steps == 3 and spec.stats.accepted_tokens == 2


def test_the_draft_length_follows_the_requests_acceptance():
    spec = Speculator("NGRAM", NgramProposer(min_match=1, max_match=2), num_draft_tokens=6, max_context=1000)
    r = _req([1, 2, 3, 4, 5, 6, 7, 8, 9] * 3 + [1, 2])  # "1 2" continues with 3 4 5 6 7 8 ...
    assert spec.draft(r) == [3, 4, 5, 6, 7, 8]  # the most at first
    spec.record(r, 6, 1)  # one kept: next time one more than that
    assert spec.draft(r) == [3, 4]
    spec.record(r, 2, 2)  # all kept: twice as long
    assert spec.draft(r) == [3, 4, 5, 6]
    spec.record(r, 4, 4)
    assert len(spec.draft(r)) == 6  # (up to --speculative-num-draft-tokens)
    spec.record(r, 6, 1)
    spec.record(r, 5, 2, depth=2)  # a tree of 5 nodes whose whole depth was kept: twice as deep
    assert spec.draft(r) == [3, 4, 5, 6]
    spec.release(r)
    assert len(spec.draft(r)) == 6
