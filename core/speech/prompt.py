"""Whisper's task tokens: what the decoder is told before it writes (start, language, task, no
timestamps), and which tokens it may never write, from the checkpoint's generation_config.json."""

from __future__ import annotations

from dataclasses import dataclass

# OpenAI's API takes ISO-639-1 codes ("en"); Whisper's own names ("english") are accepted too
_NAMES = None


def _language_names() -> dict[str, str]:
    global _NAMES  # noqa: PLW0603 (a read-only table, built once on first use)
    if _NAMES is None:
        from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE

        _NAMES = {**{code: code for code in LANGUAGES}, **TO_LANGUAGE_CODE}
    return _NAMES


@dataclass(frozen=True)
class WhisperPrompt:
    start: int  # <|startoftranscript|>
    eos: int  # <|endoftext|>
    tasks: dict[str, int]  # transcribe / translate -> its token
    languages: dict[str, int]  # "en" -> <|en|>
    no_timestamps: int | None
    prev: int | None  # <|startofprev|>: what follows it is the caller's prompt (earlier text)
    suppress: tuple[int, ...]  # never written
    begin_suppress: tuple[int, ...]  # not written first (a blank, the end)
    max_length: int

    @classmethod
    def from_generation_config(cls, gen: dict, max_target_positions: int) -> WhisperPrompt:
        languages = {k.strip("<|>"): v for k, v in (gen.get("lang_to_id") or {}).items()}
        eos = gen.get("eos_token_id")
        return cls(
            start=gen["decoder_start_token_id"],
            eos=eos[0] if isinstance(eos, list) else eos,
            tasks=dict(gen.get("task_to_id") or {}),
            languages=languages if gen.get("is_multilingual", bool(languages)) else {},
            no_timestamps=gen.get("no_timestamps_token_id"),
            prev=gen.get("prev_sot_token_id"),
            suppress=tuple(gen.get("suppress_tokens") or ()),
            begin_suppress=tuple(gen.get("begin_suppress_tokens") or ()),
            max_length=min(gen.get("max_length") or max_target_positions, max_target_positions),
        )

    def language_code(self, language: str | None) -> str | None:
        """``language`` as the code of one of the model's language tokens (None: detect it);
        ValueError naming the accepted ones where the model has no such token."""
        if language is None or not self.languages:
            return None
        code = _language_names().get(language.strip().lower())
        if code not in self.languages:
            raise ValueError(f"language '{language}' is not one the model knows: use an ISO-639-1 code such as 'en'")
        return code

    def prefix(self, task: str, language: str | None) -> list[int]:
        """The tokens before the text: start, language (multilingual models), task, no timestamps."""
        ids = [self.start]
        if self.languages and language is not None:
            ids.append(self.languages[language])
        if task in self.tasks:
            ids.append(self.tasks[task])
        elif task != "transcribe":
            raise ValueError(f"the model does not {task}: it has no <|{task}|> token")
        if self.no_timestamps is not None:
            ids.append(self.no_timestamps)
        return ids
