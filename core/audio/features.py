"""Whisper's log-mel features in torch: the model's 30 s windows of samples to (mel bins x frames).

The numbers follow the model's ``preprocessor_config.json`` (``feature_size`` mel bins,
``sampling_rate``, ``n_fft``, ``hop_length``, ``chunk_length`` seconds a window), so large-v3's 128
bins and the older 80 come from the same code; tests check the features equal transformers'
``WhisperFeatureExtractor`` on the same samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Slaney's mel scale: linear below 1 kHz, logarithmic above (librosa's and Whisper's default)
_F_SP = 200.0 / 3
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOGSTEP = math.log(6.4) / 27.0


def _hz_to_mel(hz: torch.Tensor) -> torch.Tensor:
    return torch.where(hz < _MIN_LOG_HZ, hz / _F_SP, _MIN_LOG_MEL + torch.log(hz / _MIN_LOG_HZ) / _LOGSTEP)


def _mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    return torch.where(mel < _MIN_LOG_MEL, mel * _F_SP, _MIN_LOG_HZ * torch.exp(_LOGSTEP * (mel - _MIN_LOG_MEL)))


def mel_filters(n_fft: int, n_mels: int, sample_rate: int, max_hz: float = 8000.0) -> torch.Tensor:
    """(n_fft // 2 + 1, n_mels) triangular filters, Slaney-normalised (each filter's area is
    constant), computed in float64 as transformers' ``mel_filter_bank`` does, then float32."""
    fft_hz = torch.linspace(0, sample_rate // 2, n_fft // 2 + 1, dtype=torch.float64)
    limits = torch.tensor([0.0, max_hz], dtype=torch.float64)
    edges = _mel_to_hz(torch.linspace(*_hz_to_mel(limits).tolist(), n_mels + 2, dtype=torch.float64))
    widths = edges.diff()
    slopes = edges[None, :] - fft_hz[:, None]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = torch.clamp(torch.minimum(down, up), min=0.0)
    filters *= 2.0 / (edges[2:] - edges[:-2])
    return filters.float()


@dataclass(frozen=True)
class WhisperFeatures:
    """A Whisper model's feature extractor, from its preprocessor config."""

    n_mels: int = 80
    sample_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    chunk_seconds: int = 30

    @classmethod
    def from_config(cls, config: dict) -> WhisperFeatures:
        return cls(
            n_mels=config.get("feature_size", 80),
            sample_rate=config.get("sampling_rate", 16000),
            n_fft=config.get("n_fft", 400),
            hop_length=config.get("hop_length", 160),
            chunk_seconds=config.get("chunk_length", 30),
        )

    @property
    def window_samples(self) -> int:
        return self.chunk_seconds * self.sample_rate

    @property
    def frames(self) -> int:
        """Frames one window's features hold (3000 for 30 s at a hop of 10 ms)."""
        return self.window_samples // self.hop_length

    def windows(self, samples: torch.Tensor) -> list[torch.Tensor]:
        """Long audio in the model's windows (30 s; the last one shorter), back to back: the model
        reads one window at a time and the texts are joined."""
        n = self.window_samples
        return [samples[i : i + n] for i in range(0, max(len(samples), 1), n)]

    def __call__(self, windows: list[torch.Tensor]) -> torch.Tensor:
        """(batch, n_mels, frames) log-mel features of windows of at most ``window_samples``
        samples each, zero-padded to a whole window as Whisper was trained."""
        batch = torch.zeros(len(windows), self.window_samples)
        for i, w in enumerate(windows):
            assert len(w) <= self.window_samples, "split long audio with windows() first"
            batch[i, : len(w)] = torch.as_tensor(w, dtype=torch.float32)
        window = torch.hann_window(self.n_fft)
        stft = torch.stft(batch, self.n_fft, self.hop_length, window=window, return_complex=True)
        power = (stft[..., :-1].abs() ** 2).contiguous()  # the last frame is dropped, as Whisper does
        filters = mel_filters(self.n_fft, self.n_mels, self.sample_rate)
        log_spec = torch.clamp(filters.T @ power, min=1e-10).log10()
        # an 80 dB floor under each window's loudest bin
        log_spec = torch.maximum(log_spec, log_spec.amax(dim=(1, 2), keepdim=True) - 8.0)
        return (log_spec + 4.0) / 4.0
