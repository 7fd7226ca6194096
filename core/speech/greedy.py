"""Whisper's decoding of a batch of windows: the language detected where not given, then token by
token under the checkpoint's suppressions, each window until its end token or the decoder's length.
Greedy at temperature 0 (what transformers' ``generate`` does by default, which the tests check
token for token), sampled above it."""

from __future__ import annotations

import torch

from llmkit.core.speech.model import SpeechToText
from llmkit.core.speech.prompt import WhisperPrompt


def detect_languages(model: SpeechToText, state, prompt: WhisperPrompt, n: int) -> list[str]:
    """Each window's most likely language: the decoder's first token after <|startoftranscript|>,
    among the language tokens. ``state`` is consumed (its cache holds the start token after)."""
    logits = model.decode(state, torch.full((n, 1), prompt.start, dtype=torch.long)).cpu()
    codes = list(prompt.languages)
    ids = torch.tensor([prompt.languages[c] for c in codes])
    return [codes[i] for i in logits[:, ids].argmax(dim=-1).tolist()]


def decode_windows(
    model: SpeechToText,
    features: torch.Tensor,
    prompt: WhisperPrompt,
    task: str,
    language: str | None,
    *,
    previous: list[int] = (),
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[list[list[int]], list[str | None]]:
    """The text tokens of each window of ``features`` (prefix and end token left out) and the
    language each was decoded in. ``previous``: the caller's prompt tokens, after <|startofprev|>."""
    n = features.shape[0]
    languages: list[str | None] = [language] * n
    if language is None and prompt.languages:
        languages = detect_languages(model, model.encode(features), prompt, n)
    state = model.encode(features)
    head = [prompt.prev, *previous] if previous and prompt.prev is not None else []
    rows = [head + prompt.prefix(task, lang) for lang in languages]
    width = len(rows[0])
    assert all(len(r) == width for r in rows), "one prefix length for the whole batch"
    suppress = torch.tensor(prompt.suppress, dtype=torch.long)
    begin = torch.tensor(prompt.begin_suppress, dtype=torch.long)
    out: list[list[int]] = [[] for _ in range(n)]
    done = torch.zeros(n, dtype=torch.bool)
    # the sampling side runs on the CPU: a step's logits are one row per window
    logits = model.decode(state, torch.tensor(rows, dtype=torch.long)).cpu()
    for step in range(prompt.max_length - width):
        if len(suppress):
            logits[:, suppress] = float("-inf")
        if step == 0 and len(begin):
            logits[:, begin] = float("-inf")
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            token = logits.argmax(dim=-1)
        token = torch.where(done, prompt.eos, token)
        for i, t in enumerate(token.tolist()):
            if not done[i] and t != prompt.eos:
                out[i].append(t)
        done |= token == prompt.eos
        if bool(done.all()) or step == prompt.max_length - width - 1:
            break
        logits = model.decode(state, token[:, None]).cpu()
    return out, languages
