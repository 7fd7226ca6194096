"""Real speech for the audio tests: sentences synthesized by Debian's espeak-ng (no file is
downloaded), and the same samples encoded into each container with PyAV."""

from __future__ import annotations

import io
import shutil
import subprocess
import tempfile
import wave
from pathlib import Path

import numpy as np
import pytest

# container -> (PyAV format, codec, encoder sample rate)
CONTAINERS = {
    "wav": ("wav", "pcm_s16le", None),
    "mp3": ("mp3", "libmp3lame", 22050),
    "flac": ("flac", "flac", None),
    "ogg": ("ogg", "vorbis", None),  # ffmpeg's own vorbis encoder: stereo only, "experimental"
    "opus": ("ogg", "libopus", 48000),
    "m4a": ("ipod", "aac", None),
    "webm": ("webm", "libopus", 48000),
}


def speech(text: str, *, voice: str = "en") -> tuple[np.ndarray, int]:
    """``text`` spoken by espeak-ng: mono float32 samples in [-1, 1] and their rate (22,050 Hz)."""
    if shutil.which("espeak-ng") is None:
        pytest.fail("espeak-ng is not installed (apt-get install espeak-ng; .ci/run installs it)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "speech.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-w", str(path), text], check=True, capture_output=True)
        with wave.open(str(path)) as w:
            rate, frames = w.getframerate(), w.readframes(w.getnframes())
    return np.frombuffer(frames, np.int16).astype(np.float32) / 32768.0, rate


def encode(samples: np.ndarray, rate: int, container: str, *, channels: int = 1) -> bytes:
    """``samples`` (mono float32) encoded into ``container`` (a key of CONTAINERS), in memory."""
    import av

    fmt, codec, codec_rate = CONTAINERS[container]
    if codec == "vorbis":
        channels = 2
    buf = io.BytesIO()
    layout = "mono" if channels == 1 else "stereo"
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=codec_rate or rate, layout=layout)
        stream.codec_context.options = {"strict": "experimental"}
        resampler = av.AudioResampler(format=stream.codec_context.format.name, layout=layout, rate=codec_rate or rate)
        # packed samples interleave the channels: L0 R0 L1 R1 ...
        pcm = np.repeat(samples.astype(np.float32), channels).reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(pcm, format="flt", layout=layout)
        frame.sample_rate = rate
        for f in resampler.resample(frame) + resampler.resample(None):
            for packet in stream.encode(f):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()
