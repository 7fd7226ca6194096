"""The byte-level detokenizer path (a byte table instead of two ``decode`` calls a token) gives
exactly the text and the per-step deltas of the ``decode`` path, and of ``tok.decode`` itself, on
real byte-level BPE tokenizers: the embedded SmolLM2's, the benchmarks' ``tiny`` preset's, and one
with added tokens that the ByteLevel decoder treats in every way it can (spaces, newlines, byte
characters, normalized contents, special or not). Other tokenizers keep the ``decode`` path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from llmkit.core.engine.detokenizer import IncrementalDetokenizer, _gpt2_byte_chars, byte_level_table
from llmkit.core.model.loader.source import resolve_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from gpu_presets import write_model_dir  # noqa: E402

SYMBOLS = _gpt2_byte_chars()
TEXTS = [
    "Hello, world! 你好，世界。",
    "🙂👍🏽 naïve café — done.",
    "def f(x):\n    return x ** 2  # ✓",
    "Zürich → 東京 🚄",
]


def _as_symbols(text: str) -> str:
    return "".join(SYMBOLS[b] for b in text.encode())


def _custom_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with an NFC normalizer (as Qwen's) and added tokens of every kind."""
    vocab = {"<eos>": 0, **{c: 1 + i for i, c in enumerate(SYMBOLS)}}
    for word in (" café", "🙂", "你", " hello", "é", " world", "\n\n"):
        vocab.setdefault(_as_symbols(word), len(vocab))
    tok = Tokenizer(models.BPE(vocab, [], fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken("<eos>", special=True),
            AddedToken("<|im_start|>", special=True),
            AddedToken("<sp é>", special=True),  # a space: its own UTF-8, not byte characters
            AddedToken("Ġsp", special=True),  # byte characters: " sp"
            AddedToken("<nrm e\u0301>", special=True, normalized=True),  # decodes NFC'd, then is not skipped
        ]
    )
    tok.add_tokens(
        [
            AddedToken("hello world"),
            AddedToken("line\nbreak"),
            AddedToken("Ġx"),
            AddedToken("café"),  # é is byte 0xE9's character: decodes to "caf\ufffd"
            AddedToken("e\u0301", normalized=True),
            AddedToken("🙂 ok"),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def smollm2():
    return AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-preset")
    write_model_dir("tiny", d)
    return AutoTokenizer.from_pretrained(str(d))


@pytest.fixture(scope="module")
def custom():
    return _custom_tokenizer()


@pytest.fixture(params=["smollm2", "tiny", "custom"])
def tok(request):
    return request.getfixturevalue(request.param)


def _decode(tok, ids, skip):
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _pool(tok) -> list[int]:
    """Ids worth mixing: every byte's token (so characters split across tokens, lone continuation
    bytes and bytes UTF-8 never has), special and added tokens, whole words and emoji, a few
    arbitrary ids and one past the vocabulary."""
    ids = [tok.convert_tokens_to_ids(c) for c in SYMBOLS]
    ids += [b for b in ids[0x80:]] * 2  # mostly the bytes that make characters
    ids += list(tok.added_tokens_decoder) * 2
    for text in TEXTS:
        ids += tok(text, add_special_tokens=False)["input_ids"]
    ids += list(range(0, len(tok), max(1, len(tok) // 64))) + [len(tok) + 3]
    return ids


def _run(tok, prompt, out, skip, stop, fast):
    d = IncrementalDetokenizer(tok, prompt, skip, stop=stop, fast=fast)
    assert d.fast == (fast and byte_level_table(tok) is not None)
    steps = []
    for t in out:
        hit = d.add_token(t)
        steps.append((hit.text if hit else None, d.take_delta(final=False), d.text, d.emitted))
        if hit:
            break
    d.flush()
    steps.append((None, d.take_delta(final=True), d.text, d.emitted))
    return steps


def test_smollm2_takes_the_byte_table(smollm2):
    assert byte_level_table(smollm2) is not None
    for skip in (True, False):
        assert IncrementalDetokenizer(smollm2, [1, 2, 3], skip).fast


@pytest.mark.parametrize("skip", [True, False])
def test_table_matches_decode_for_every_id(tok, skip):
    table = byte_level_table(tok)
    assert table is not None
    ids = list(range(len(tok) + 2))
    got = [table.lookup(i, skip) for i in ids]
    want = [_decode(tok, [i], skip) for i in ids]
    assert [b.decode("utf-8", "replace") for b in got] == want
    assert b"".join(got).decode("utf-8", "replace") == _decode(tok, ids, skip)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_byte_level_path_matches_decode_path(tok, data):
    pool = _pool(tok)
    prompt = data.draw(st.lists(st.sampled_from(pool), max_size=8), label="prompt")
    out = data.draw(st.lists(st.sampled_from(pool), max_size=40), label="out")
    skip = data.draw(st.booleans(), label="skip")
    stop = ()
    text = _decode(tok, out, skip)
    if text and data.draw(st.booleans(), label="with stop"):
        i = data.draw(st.integers(0, len(text) - 1))
        stop = (text[i : i + data.draw(st.integers(1, 4))],)
    fast = _run(tok, prompt, out, skip, stop, fast=True)
    assert fast == _run(tok, prompt, out, skip, stop, fast=False)
    released = "".join(delta for _, delta, _, _ in fast)
    # Both paths slice each decode after the prompt context's text; unless that context ends in
    # the middle of a character, that is the output's own decode.
    ctx = prompt[-IncrementalDetokenizer.CONTEXT :]
    if not stop and _decode(tok, ctx + out, skip) == _decode(tok, ctx, skip) + text:
        assert released == text


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_split_characters_and_emoji_stream_whole(smollm2, text, skip):
    """Every character split into its byte tokens (a skipped special token between them): held
    until complete, then released whole."""
    ids = [smollm2.convert_tokens_to_ids(c) for c in _as_symbols(text)]
    if skip:
        ids = [x for t in ids for x in (t, 2)]  # <|im_end|> between every byte
    steps = _run(smollm2, [5, 6], ids, skip, (), fast=True)
    assert steps == _run(smollm2, [5, 6], ids, skip, (), fast=False)
    deltas = [delta for _, delta, _, _ in steps]
    assert "".join(deltas) == _decode(smollm2, ids, skip)
    assert not any("\ufffd" in d for d in deltas)


def test_prompt_ending_inside_a_character(smollm2):
    """The quirk kept: a prompt that ends in the first byte of 你 owns that character, so the
    output's bytes completing it release nothing (both paths), unlike decoding the output alone."""
    b = [smollm2.convert_tokens_to_ids(c) for c in _as_symbols("你A")]
    for fast in (True, False):
        steps = _run(smollm2, [5, b[0]], b[1:], True, (), fast=fast)
        assert "".join(delta for _, delta, _, _ in steps) == "A"


def test_bad_bytes_decode_as_tokenizers_does(custom):
    """Bytes UTF-8 never has, surrogates, over-long and truncated sequences: U+FFFD exactly where
    the tokenizer's decode puts them, also when the output ends in the middle of a character."""
    byte = {b: custom.convert_tokens_to_ids(c) for b, c in enumerate(SYMBOLS)}
    cases = [
        b"\xed\xa0\x80A",
        b"\xf0\x80\x80",
        b"\xc0\xafx",
        b"\xf4\x90\x80\x80",
        b"\xff\xfe",
        b"\xe4\xbd",
        b"a\xf0\x9f\x99",
    ]
    for raw in cases:
        ids = [byte[b] for b in raw]
        for fast in (True, False):
            steps = _run(custom, [0], ids, False, (), fast=fast)
            assert "".join(delta for _, delta, _, _ in steps) == _decode(custom, ids, False), (raw, fast)


def _wordpiece() -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "[SEP]": 1, "hello": 2, "world": 3, "##s": 4, "a": 5}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]")


def _metaspace() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "s": 3, "▁": 4}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def _no_decoder() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "s": 3, "a": 4}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def _byte_level_then_strip() -> PreTrainedTokenizerFast:
    tok = _custom_tokenizer().backend_tokenizer
    tok.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


class _OwnDecode(PreTrainedTokenizerFast):
    def decode(self, token_ids, **kwargs):
        return super().decode(token_ids, **kwargs).upper()


@pytest.mark.parametrize("make", [_wordpiece, _metaspace, _no_decoder, _byte_level_then_strip])
def test_other_tokenizers_keep_the_decode_path(make):
    tok = make()
    assert byte_level_table(tok) is None
    ids = [2, 4, 3, 1, 2] if make is _wordpiece else [1, 3, 2, 2, 4, 1]
    d = IncrementalDetokenizer(tok, [2], True)
    assert not d.fast
    for t in ids:
        d.add_token(t)
    d.flush()
    want = _decode(tok, [2, *ids], True)[len(_decode(tok, [2], True)) :]
    assert d.text == want
    assert _run(tok, [2], ids, True, (), fast=True) == _run(tok, [2], ids, True, (), fast=False)


def test_a_sequence_of_byte_level_alone_is_byte_level():
    tok = _custom_tokenizer()
    tok.backend_tokenizer.decoder = decoders.Sequence([decoders.ByteLevel()])
    assert byte_level_table(tok) is not None


def test_a_tokenizer_with_its_own_decode_keeps_the_decode_path():
    tok = _OwnDecode(tokenizer_object=_custom_tokenizer().backend_tokenizer)
    assert byte_level_table(tok) is None
    d = IncrementalDetokenizer(tok, [0], True)
    for t in tok("hello", add_special_tokens=False)["input_ids"]:
        d.add_token(t)
    assert not d.fast and d.text == "HELLO"


def test_added_tokens_refresh_the_table():
    tok = _custom_tokenizer()
    assert byte_level_table(tok) is not None
    tok.add_special_tokens({"additional_special_tokens": ["<new>"]})
    new = tok.convert_tokens_to_ids("<new>")
    table = byte_level_table(tok)
    assert table.lookup(new, skip=True) == b"" and table.lookup(new, skip=False) == b"<new>"
