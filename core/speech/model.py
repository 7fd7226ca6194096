"""The contract encoder-decoder speech models (Whisper) implement for transcription.

The encoder reads one window of log-mel features at once; the decoder then writes text one token
at a time, attending to its own earlier tokens (a K/V cache that grows) and to the encoder's
states (a cross-attention K/V computed once per window). Until the engine serves these models
with its paged pools, the cache is a plain object the model owns per batch of windows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch


class SpeechToText(ABC):
    """Features in, text tokens out: ``encode`` once per window, then ``decode`` step by step."""

    n_mels: int  # the mel bins its encoder reads
    max_target_positions: int  # the most tokens (prompt and text) one window's decoder holds
    vocab_size: int

    @classmethod
    @abstractmethod
    def from_pretrained(cls, model_dir: Path, config: dict, device: torch.device, dtype: torch.dtype) -> SpeechToText:
        """Build the model from ``config`` (config.json) and load its safetensors weights by name."""

    @abstractmethod
    def encode(self, features: torch.Tensor) -> Any:
        """A decoding state for ``features`` ``[batch, n_mels, frames]``: the encoder's output,
        its cross-attention K/V, and an empty self-attention cache."""

    @abstractmethod
    def decode(self, state: Any, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, vocab]`` (fp32) of the next token after ``tokens`` ``[batch, n]``, the
        tokens that follow those already fed to ``state`` (whose cache grows by ``n``)."""
