"""llmkit's Whisper (plugins/models/whisper.py, decoded by core/speech/greedy.py) writes the tokens
transformers' ``generate`` writes, on the same features of espeak-ng speech: alone and batched,
with the language given or detected, transcribing and translating, after a prompt."""

from __future__ import annotations

import json

import pytest
import torch

from llmkit.core.audio.decode import decode_audio
from llmkit.core.audio.features import WhisperFeatures
from llmkit.core.speech.greedy import decode_windows
from llmkit.core.speech.prompt import WhisperPrompt
from llmkit.plugins.models.speech.whisper import WhisperForConditionalGeneration

from audio_utils import encode, speech
from whisper_utils import tiny_whisper


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    path = tmp_path_factory.mktemp("whisper")
    reference = tiny_whisper(path)
    config = json.loads((path / "config.json").read_text())
    ours = WhisperForConditionalGeneration.from_pretrained(path, config, torch.device("cpu"), torch.float32)
    gen = json.loads((path / "generation_config.json").read_text())
    prompt = WhisperPrompt.from_generation_config(gen, ours.max_target_positions)
    features = WhisperFeatures.from_config(json.loads((path / "preprocessor_config.json").read_text()))
    return reference, ours, prompt, features


@pytest.fixture(scope="module")
def windows(whisper) -> torch.Tensor:
    """Three windows' features: two sentences and the first second of the first."""
    *_, features = whisper
    samples = []
    for text in ("The quick brown fox jumps over the lazy dog.", "Hello world, speech to text."):
        audio, rate = speech(text)
        samples.append(torch.from_numpy(decode_audio(encode(audio, rate, "flac"), 16000)))
    samples.append(samples[0][:16000])
    return features(samples)


def _reference(model, features, n_prefix: int, **kw) -> list[list[int]]:
    """transformers' tokens (it returns them without the prefix), up to the end token (left out)
    or as many as fit the decoder's positions after the prefix: transformers goes on past them
    where no end token came (a second pass over the window), which llmkit does not."""
    limit = model.config.max_target_positions - n_prefix
    out = model.generate(features, max_new_tokens=limit, **kw)
    eos = model.generation_config.eos_token_id
    return [(row[: row.index(eos)] if eos in row else row)[:limit] for row in out.tolist()]


def test_encoder_and_first_logits_equal_transformers(whisper, windows):
    reference, ours, prompt, _ = whisper
    prefix = torch.tensor([prompt.prefix("transcribe", "en")] * len(windows))
    expected = reference(input_features=windows, decoder_input_ids=prefix).logits[:, -1]
    got = ours.decode(ours.encode(windows), prefix)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("task", ["transcribe", "translate"])
def test_batched_and_alone_equal_transformers_generate(whisper, windows, task):
    reference, ours, prompt, _ = whisper
    expected = _reference(reference, windows, 4, language="en", task=task)
    got, languages = decode_windows(ours, windows, prompt, task, "en")
    assert got == expected and languages == ["en"] * 3
    assert len({tuple(t) for t in got}) > 1  # the windows' texts differ: the test can tell them apart
    alone, _ = decode_windows(ours, windows[1:2], prompt, task, "en")
    assert alone == [expected[1]]


def test_language_detection_equals_transformers(whisper, windows):
    reference, ours, prompt, _ = whisper
    got, languages = decode_windows(ours, windows[:1], prompt, "transcribe", None)
    detected = reference.detect_language(windows[:1])  # <|xx|> token ids
    assert [prompt.languages[c] for c in languages] == detected.tolist()
    assert got == _reference(reference, windows[:1], 4, task="transcribe")


def test_a_prompt_precedes_the_task_tokens(whisper, windows):
    """Greedy after <|startofprev|> and the prompt: each token is transformers' argmax given the
    tokens before it, under the same suppressions (teacher-forced: its ``generate`` conditions on a
    prompt in ways of its own)."""
    reference, ours, prompt, _ = whisper
    previous = [5, 17, 42]
    got, _ = decode_windows(ours, windows[:1], prompt, "transcribe", "en", previous=previous)
    ids = [prompt.prev, *previous, *prompt.prefix("transcribe", "en"), *got[0]]
    with torch.no_grad():
        logits = reference(input_features=windows[:1], decoder_input_ids=torch.tensor([ids[:-1]])).logits[0]
    width = len(ids) - len(got[0])
    steps = logits[width - 1 :].clone()
    steps[:, list(prompt.suppress)] = float("-inf")  # the checkpoint's suppressions, as generate applies them
    steps[0, list(prompt.begin_suppress)] = float("-inf")
    assert steps.argmax(dim=-1).tolist() == got[0]
    assert got != decode_windows(ours, windows[:1], prompt, "transcribe", "en")[0]


def test_task_and_language_refusals(whisper):
    _, _, prompt, _ = whisper
    with pytest.raises(ValueError, match="ISO-639-1"):
        prompt.language_code("klingon")
    assert prompt.language_code("English") == "en" and prompt.language_code("de") == "de"
