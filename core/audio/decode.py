"""Uploaded audio to mono float32 samples at the model's rate, decoded in memory with PyAV.

PyAV's wheels bundle ffmpeg's demuxers, decoders and resampler, so wav, mp3, flac, ogg (vorbis,
opus), m4a (aac) and webm decode with no system package and no subprocess, from bytes in memory:
nothing of an upload touches the disk. Debian's ffmpeg CLI would need a temporary file or a pipe
per request and a process per request; transformers' pipeline mixes to mono and resamples with the
same swresample, so both read the same samples.

Every refusal is an :class:`AudioError` carrying its HTTP status: the server answers it in OpenAI's
error shape and serves on.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

# Below telephone rates no speech survives; above 768 kHz no recorder writes. A header outside
# these is a broken or hostile file (a rate of 1 Hz makes a few bytes last for hours).
MIN_SAMPLE_RATE = 1000
MAX_SAMPLE_RATE = 768_000
# Decoded audio shorter than the header declares by more than this is a truncated file (mp3 and
# ogg durations are estimates from the bitrate: a few percent off on a whole file).
_TRUNCATION_SLACK = 0.05
_TRUNCATION_SECONDS = 0.5


class AudioError(ValueError):
    """Audio the server will not use; the message names the reason, ``status`` the HTTP answer."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_audio") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True)
class AudioLimits:
    max_bytes: int = 25 << 20  # OpenAI's cap on transcription uploads
    max_seconds: float = 1800.0


def decode_audio(data: bytes, sample_rate: int, limits: AudioLimits = AudioLimits()) -> np.ndarray:
    """The first audio stream of ``data`` (any container and codec ffmpeg decodes) as mono float32
    samples at ``sample_rate``; :class:`AudioError` for what cannot or may not be used."""
    try:
        import av
    except ImportError:
        raise AudioError("Audio decoding needs PyAV: pip install 'llmkit[audio]'.", status=501) from None

    if not data:
        raise AudioError("The audio file is empty.", code="empty_file")
    if len(data) > limits.max_bytes:
        raise AudioError(
            f"The audio file is {len(data)} bytes; the limit is {limits.max_bytes} (--max-audio-bytes).",
            status=413,
            code="file_too_large",
        )
    # ffmpeg decodes what a cut-off wav or ogg holds and says nothing: their framing tells
    cut = _cut_off(data)
    if cut:
        raise AudioError(f"The audio file is truncated: {cut}.", code="truncated_file")
    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except av.error.FFmpegError as exc:
        raise AudioError(f"The file is not audio in a format that can be decoded ({_reason(exc)}).") from None
    with container:
        if not container.streams.audio:
            raise AudioError("The file holds no audio stream.")
        stream = container.streams.audio[0]
        rate = stream.codec_context.sample_rate or 0
        if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
            raise AudioError(
                f"The audio declares a sample rate of {rate} Hz; rates from {MIN_SAMPLE_RATE} to "
                f"{MAX_SAMPLE_RATE} Hz are accepted.",
                code="invalid_sample_rate",
            )
        declared = _declared_seconds(container, stream)
        if declared is not None and declared > limits.max_seconds + 1:
            raise _too_long(declared, limits)
        samples = _decode_stream(container, stream, sample_rate, limits)
    seconds = len(samples) / sample_rate
    if seconds == 0:
        raise AudioError("The audio holds no samples.", code="empty_audio")
    if declared is not None and seconds < declared - max(_TRUNCATION_SECONDS, _TRUNCATION_SLACK * declared):
        raise AudioError(
            f"The audio file is truncated: it declares {declared:.2f} s and holds {seconds:.2f} s.",
            code="truncated_file",
        )
    return samples


def _decode_stream(container, stream, sample_rate: int, limits: AudioLimits) -> np.ndarray:
    import av

    # One resampler for the whole stream: it converts to planar float at the model's rate and keeps
    # its filter state across frames (a resampler per frame would click at every frame boundary).
    # The channels are averaged here, not by swresample: to float it mixes stereo at 1/sqrt(2) a
    # channel, louder than the mean Whisper was trained on (ffmpeg to 16-bit, normalised: 1/2 each).
    resampler = av.AudioResampler(format="fltp", rate=sample_rate)
    cap = int(limits.max_seconds * sample_rate)
    chunks, total = [], 0
    try:
        for frame in container.decode(stream):
            if frame.sample_rate and not MIN_SAMPLE_RATE <= frame.sample_rate <= MAX_SAMPLE_RATE:
                raise AudioError(f"A frame of the audio has a sample rate of {frame.sample_rate} Hz.")
            for out in resampler.resample(frame):
                chunk = out.to_ndarray().mean(axis=0, dtype=np.float32)
                chunks.append(chunk)
                total += len(chunk)
            if total > cap:  # stop decoding at once: an hour of audio is refused, not decoded
                raise _too_long(total / sample_rate, limits, at_least=True)
        for out in resampler.resample(None):
            chunks.append(out.to_ndarray().mean(axis=0, dtype=np.float32))
    except av.error.FFmpegError as exc:
        raise AudioError(f"The audio could not be decoded: it is truncated or corrupt ({_reason(exc)}).") from None
    if not chunks:
        return np.zeros(0, np.float32)
    return np.concatenate(chunks).astype(np.float32, copy=False)


def _cut_off(data: bytes) -> str | None:
    """Where a RIFF/WAVE or Ogg file's own framing shows it was cut off: a wav whose data chunk
    declares more bytes than follow it (ffmpeg clamps the duration to what is there), an Ogg
    stream whose last page is incomplete or not marked end-of-stream (its duration is read from
    that last page)."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        at = 12
        while at + 8 <= len(data):
            size = int.from_bytes(data[at + 4 : at + 8], "little")
            if data[at : at + 4] == b"data":
                # writers to a pipe cannot seek back to write the size: they leave a placeholder near
                # a RIFF size's limit (espeak-ng --stdout: 0x7FFFF000; ffmpeg: 0xFFFFFFFF)
                if size < 0x7FFF_F000 and at + 8 + size > len(data):
                    return f"its data chunk declares {size} bytes and {len(data) - at - 8} follow"
                return None
            at += 8 + size + (size & 1)  # chunks are padded to even sizes
        return None
    if data[:4] == b"OggS":
        last = data.rfind(b"OggS")
        if last + 27 > len(data):
            return "its last Ogg page is cut off"
        segments = data[last + 27 : last + 27 + data[last + 26]]
        if last + 27 + data[last + 26] + sum(segments) != len(data):
            return "its last Ogg page is cut off"
        if not data[last + 5] & 0x04:
            return "its last Ogg page does not end the stream"
    return None


def _declared_seconds(container, stream) -> float | None:
    """The duration the file's header declares (None where it declares none)."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000  # av.time_base: microseconds
    return None


def _too_long(seconds: float, limits: AudioLimits, at_least: bool = False) -> AudioError:
    more = "over " if at_least else ""
    return AudioError(
        f"The audio lasts {more}{seconds:.0f} s; the limit is {limits.max_seconds:.0f} s (--max-audio-seconds).",
        code="audio_too_long",
    )


def _reason(exc: Exception) -> str:
    return getattr(exc, "strerror", None) or type(exc).__name__
