"""Uploads to samples: each container decodes to the speech that was encoded into it, mixed to mono
and resampled to the model's rate; and each kind of bad upload is refused with its own 4xx."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest

from llmkit.core.audio.decode import AudioError, AudioLimits, decode_audio

from audio_utils import CONTAINERS, encode, speech

RATE = 16000


@pytest.fixture(scope="module")
def sentence() -> tuple[np.ndarray, int]:
    return speech("The quick brown fox jumps over the lazy dog.")


@pytest.fixture(scope="module")
def reference(sentence) -> np.ndarray:
    """The sentence at 16 kHz from lossless PCM: what every lossy container must come close to."""
    return decode_audio(encode(*sentence, "wav"), RATE)


def _aligned_correlation(a: np.ndarray, b: np.ndarray, max_lag: int = 1500) -> float:
    """The best correlation of ``a`` and ``b`` over lags up to ``max_lag`` samples (AAC's encoder
    delay shifts the audio by 1,024 samples of its own rate; the others decode aligned)."""
    n = min(len(a), len(b)) - max_lag
    spectrum = np.fft.irfft(np.fft.rfft(a[:n], 2 * n) * np.conj(np.fft.rfft(b[:n], 2 * n)))
    lag = int(np.argmax(np.abs(np.concatenate([spectrum[-max_lag:], spectrum[: max_lag + 1]])))) - max_lag
    x, y = (a[lag:], b) if lag >= 0 else (a, b[-lag:])
    m = min(len(x), len(y))
    return float(np.corrcoef(x[:m], y[:m])[0, 1])


def _wav(samples: np.ndarray, rate: int, channels: int = 1) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def test_lossless_pcm_at_its_own_rate_is_the_samples_themselves(sentence):
    samples, rate = sentence
    decoded = decode_audio(encode(samples, rate, "wav"), rate)
    assert decoded.dtype == np.float32 and decoded.shape == samples.shape
    np.testing.assert_allclose(decoded, samples, atol=1 / 32768)


@pytest.mark.parametrize("container", sorted(CONTAINERS))
def test_each_container_decodes_to_the_speech_in_it(container, sentence, reference):
    samples, rate = sentence
    decoded = decode_audio(encode(samples, rate, container), RATE)
    assert decoded.dtype == np.float32 and decoded.ndim == 1
    # same length but for the codecs' frame padding, and the same waveform but for their loss
    assert abs(len(decoded) - len(reference)) < 0.06 * RATE, (len(decoded), len(reference))
    assert _aligned_correlation(reference, decoded) > 0.98


def test_a_wav_written_to_a_pipe_is_not_truncated(reference):
    """espeak-ng --stdout cannot seek back to write the data size: it leaves a placeholder."""
    import subprocess

    piped = subprocess.run(
        ["espeak-ng", "--stdout", "The quick brown fox jumps over the lazy dog."], check=True, capture_output=True
    ).stdout
    assert int.from_bytes(piped[40:44], "little") == 0x7FFF_F000
    np.testing.assert_array_equal(decode_audio(piped, RATE), reference)


def test_stereo_is_mixed_to_mono(sentence, reference):
    samples, rate = sentence
    stereo = np.stack([samples, 0.5 * samples], axis=1).reshape(-1)  # left, then half as loud right
    decoded = decode_audio(_wav(stereo, rate, channels=2), RATE)
    np.testing.assert_allclose(decoded, 0.75 * reference, atol=2e-3)


def test_resampling_keeps_the_pitch_and_the_duration():
    rate = 44100
    t = np.arange(2 * rate) / rate
    decoded = decode_audio(_wav(0.5 * np.sin(2 * np.pi * 440 * t), rate), RATE)
    assert len(decoded) == 2 * RATE
    peak = np.argmax(np.abs(np.fft.rfft(decoded))) * RATE / len(decoded)
    assert peak == pytest.approx(440, abs=1)
    assert np.abs(decoded).max() == pytest.approx(0.5, abs=0.02)


# --- refusals: each a 4xx with a message that says what is wrong ---------------------------------


def _refused(data: bytes, limits: AudioLimits = AudioLimits()) -> AudioError:
    with pytest.raises(AudioError) as caught:
        decode_audio(data, RATE, limits)
    assert 400 <= caught.value.status < 500
    return caught.value


@pytest.mark.parametrize(
    "data",
    [b"This is a text file, not audio.\n" * 20, bytes(range(256)) * 40, b"RIFF\x00\x00\x00\x00WAVE", b"\xff\xfb"],
    ids=["text", "binary", "bare-riff-header", "mp3-sync-only"],
)
def test_not_audio(data):
    assert _refused(data).status == 400


def test_empty_file_and_empty_audio():
    assert _refused(b"").code == "empty_file"
    assert _refused(_wav(np.zeros(0), RATE)).code == "empty_audio"


def test_a_file_without_an_audio_stream():
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        video = out.add_stream("mpeg4", rate=5)
        video.width, video.height, video.pix_fmt = 32, 32, "yuv420p"
        for _ in range(3):
            frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")
            for packet in video.encode(frame):
                out.mux(packet)
        for packet in video.encode(None):
            out.mux(packet)
    assert "no audio stream" in str(_refused(buf.getvalue()))


@pytest.mark.parametrize("container", sorted(CONTAINERS))
def test_truncated_files(container, sentence):
    data = encode(*sentence, container)
    error = _refused(data[: len(data) // 2])
    assert "truncated" in str(error) or "not audio" in str(error)  # m4a: cut before its index


@pytest.mark.parametrize("rate", [1, 999, 1_000_000])
def test_absurd_sample_rates(rate):
    error = _refused(_wav(np.zeros(4000), rate))
    assert error.code == "invalid_sample_rate" and f"{rate} Hz" in str(error)


def test_uploads_over_the_byte_limit_are_413(sentence):
    data = encode(*sentence, "flac")
    error = _refused(data, AudioLimits(max_bytes=len(data) - 1))
    assert (error.status, error.code) == (413, "file_too_large")
    assert len(decode_audio(data, RATE, AudioLimits(max_bytes=len(data)))) > 0


@pytest.mark.parametrize("container", ["wav", "mp3", "webm"])
def test_audio_over_the_duration_limit(container, sentence):
    data = encode(*sentence, container)
    error = _refused(data, AudioLimits(max_seconds=1.0))
    assert error.code == "audio_too_long" and "--max-audio-seconds" in str(error)


def test_an_hour_of_audio_is_refused_from_its_header():
    # an hour of silence at 8 kHz, FLAC-compressed to a few hundred kB: refused before decoding
    data = encode(np.zeros(3600 * 8000, np.float32), 8000, "flac")
    assert len(data) < 2 << 20
    assert _refused(data).code == "audio_too_long"
