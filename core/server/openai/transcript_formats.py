"""A transcript in each of OpenAI's ``response_format`` values: json, text, srt, vtt, verbose_json."""

from __future__ import annotations

from llmkit.core.speech.engine import Transcript

FORMATS = ("json", "text", "srt", "vtt", "verbose_json")


def _clock(seconds: float, decimal: str) -> str:
    ms = round(seconds * 1000)
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{decimal}{ms:03d}"


def srt(t: Transcript) -> str:
    """SubRip: numbered cues, ``HH:MM:SS,mmm --> HH:MM:SS,mmm``, a blank line after each."""
    cues = [
        f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n"
        for i, s in enumerate((s for s in t.segments if s.text.strip()), 1)
    ]
    return "\n".join(cues)


def vtt(t: Transcript) -> str:
    """WebVTT: the ``WEBVTT`` header, then cues with ``HH:MM:SS.mmm --> HH:MM:SS.mmm``."""
    cues = [
        f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n" for s in t.segments if s.text.strip()
    ]
    return "WEBVTT\n\n" + "\n".join(cues)


def language_name(code: str | None) -> str | None:
    """OpenAI's verbose_json names the language in English words ("english"), as Whisper does."""
    if code is None:
        return None
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return LANGUAGES.get(code, code)


def verbose_json(t: Transcript, task: str, temperature: float) -> dict:
    return {
        "task": task,
        "language": language_name(t.language),
        "duration": round(t.duration, 3),
        "text": t.text,
        "segments": [
            {
                "id": i,
                "seek": round(s.start * 100),  # Whisper's seek is in 10 ms frames
                "start": round(s.start, 3),
                "end": round(s.end, 3),
                "text": s.text,
                "tokens": s.tokens,
                "temperature": temperature,
                # not computed yet (no log-probabilities, no no-speech head): neutral values
                "avg_logprob": 0.0,
                "compression_ratio": 1.0,
                "no_speech_prob": 0.0,
            }
            for i, s in enumerate(t.segments)
        ],
        "usage": {"type": "duration", "seconds": max(1, round(t.duration))},
    }
