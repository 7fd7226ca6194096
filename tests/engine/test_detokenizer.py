"""Incremental detokenization: never broken UTF-8, stop strings matched across token boundaries
and never released, whatever the split."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from llmkit.core.engine.detokenizer import IncrementalDetokenizer
from llmkit.core.model.loader.source import resolve_model_dir

TEXTS = [
    "Hello, world! 你好，世界。🙂👍🏽 naïve café — done.",
    "def f(x):\n    return x ** 2  # ✓\n\n\nEnd",
    "Zürich → Москва → 東京 🚄🚄🚄",
]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))


def _stream(tok, ids, stop=(), keep=False):
    d = IncrementalDetokenizer(tok, [1, 2, 3], skip_special_tokens=True, stop=stop, keep_stop=keep)
    deltas, matched = [], None
    for t in ids:
        hit = d.add_token(t)
        deltas.append(d.take_delta(final=False))
        if hit:
            matched = hit.text
            break
    d.flush()
    deltas.append(d.take_delta(final=True))
    return deltas, matched


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_are_whole_characters(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    deltas, _ = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=60, deadline=None)
@given(text=st.sampled_from(TEXTS), data=st.data())
def test_stop_strings_never_leak(tok, text, data):
    start = data.draw(st.integers(0, len(text) - 3))
    length = data.draw(st.integers(2, 6))
    stop = text[start : start + length]
    if not stop.strip():
        return
    ids = tok(text, add_special_tokens=False)["input_ids"]
    deltas, matched = _stream(tok, ids, stop=(stop,))
    out = "".join(deltas)
    full = tok.decode(ids)
    if stop in full:
        assert matched == stop
        assert out == full[: full.index(stop)]
        for i in range(1, len(deltas) + 1):  # no prefix of what was released contains the stop
            assert stop not in "".join(deltas[:i])
    else:
        assert out == full


def test_keep_stop_string(tok):
    ids = tok("one two three four", add_special_tokens=False)["input_ids"]
    deltas, matched = _stream(tok, ids, stop=(" three",), keep=True)
    assert matched == " three" and "".join(deltas) == "one two three"
