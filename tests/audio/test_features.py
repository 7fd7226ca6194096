"""Whisper's log-mel features computed by llmkit equal transformers' ``WhisperFeatureExtractor`` on
the same samples: espeak-ng's speech, decoded from each container."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor
from transformers.audio_utils import mel_filter_bank

from llmkit.core.audio.decode import decode_audio
from llmkit.core.audio.features import WhisperFeatures, mel_filters

from audio_utils import CONTAINERS, encode, speech


@pytest.fixture(scope="module")
def decoded() -> dict[str, np.ndarray]:
    """Two sentences, each container's decoding of them at 16 kHz."""
    samples, rate = speech("Speech to text, from every container. Then a second sentence, a little longer.")
    return {c: decode_audio(encode(samples, rate, c), 16000) for c in sorted(CONTAINERS)}


@pytest.mark.parametrize("n_mels", [80, 128])
def test_mel_filters_equal_transformers(n_mels):
    ref = mel_filter_bank(
        num_frequency_bins=201,
        num_mel_filters=n_mels,
        min_frequency=0.0,
        max_frequency=8000.0,
        sampling_rate=16000,
        norm="slaney",
        mel_scale="slaney",
    )
    np.testing.assert_allclose(mel_filters(400, n_mels, 16000).numpy(), ref, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("n_mels", [80, 128])  # Whisper up to large-v2, and large-v3
def test_features_of_each_container_equal_transformers(decoded, n_mels):
    extractor = WhisperFeatureExtractor(feature_size=n_mels)
    ours = WhisperFeatures.from_config(extractor.to_dict())
    assert ours.n_mels == n_mels and ours.frames == 3000
    batch = list(decoded.values())
    expected = extractor(batch, sampling_rate=16000, return_tensors="pt").input_features
    got = ours([torch.from_numpy(s) for s in batch])
    assert got.shape == expected.shape == (len(batch), n_mels, 3000)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # each window's features alone equal its features in the batch (the floor is per window)
    torch.testing.assert_close(ours([torch.from_numpy(batch[0])])[0], got[0])


def test_long_audio_is_split_into_30_second_windows(decoded):
    features = WhisperFeatures()
    speech16k = torch.from_numpy(decoded["flac"])
    long = torch.cat([speech16k] * (int(65 * 16000 / len(speech16k)) + 1))[: 65 * 16000]
    windows = features.windows(long)
    assert [len(w) for w in windows] == [480000, 480000, 5 * 16000]
    assert torch.equal(torch.cat(windows), long)
    extractor = WhisperFeatureExtractor()
    expected = extractor([w.numpy() for w in windows], sampling_rate=16000, return_tensors="pt").input_features
    torch.testing.assert_close(features(windows), expected, rtol=1e-5, atol=1e-5)
    assert len(features.windows(long[:480000])) == 1
