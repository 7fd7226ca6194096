"""The contract encoder-only models (BERT and its family) implement for embeddings.

An encoder reads whole inputs at once with bidirectional attention and keeps no KV cache, so it
needs none of the engine's paging or decode loop: one forward per batch, hidden states out.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import torch


class Encoder(ABC):
    """An encoder-only model: token ids in, one hidden state per token out."""

    hidden_size: int
    max_position: int  # the longest input its position embeddings cover

    @classmethod
    @abstractmethod
    def from_pretrained(cls, model_dir: Path, config: dict, device: torch.device, dtype: torch.dtype) -> "Encoder":
        """Build the model from ``config`` (config.json) and load its safetensors weights by name."""

    @abstractmethod
    def encode(self, inputs: list[list[int]]) -> list[torch.Tensor]:
        """The last hidden states of each input, ``[len(ids), hidden_size]`` each, in fp32.

        Inputs are batched together in one forward; an input's states must not depend on its
        batch-mates (padding is masked out of attention) beyond float noise."""


class Scorer(ABC):
    """A cross-encoder: a (query, document) pair read as one input, one relevance logit out.

    ``activation`` turns the logit into the score the routes return by default (vLLM's
    ``use_activation``, sentence-transformers' ``CrossEncoder.predict``): ``sigmoid`` for a
    one-label classifier, ``identity`` where the checkpoint says so."""

    max_position: int
    activation: str = "sigmoid"

    @classmethod
    @abstractmethod
    def from_pretrained(cls, model_dir: Path, config: dict, device: torch.device, dtype: torch.dtype) -> "Scorer":
        """Build the model from ``config`` and load its safetensors weights by name."""

    @abstractmethod
    def score(self, inputs: list[list[int]], type_ids: list[list[int]] | None = None) -> list[float]:
        """One raw logit per input (token ids of the formatted pair; ``type_ids``: the segment of
        each token, for models that read token types). Batched in one forward, independent of
        batch-mates beyond float noise."""
