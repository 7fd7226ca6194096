"""The contract a vision-language model plugin adds to :class:`~llmkit.core.model.causal_lm.CausalLM`."""

from __future__ import annotations

from abc import abstractmethod

import torch

from llmkit.core.multimodal.items import ImageItem
from llmkit.core.multimodal.processor import MultimodalProcessor


class VisionLanguageModel:
    """Mixed into a CausalLM whose prompts may hold images. Its ``forward`` reads
    ``ctx.mm`` (:class:`~llmkit.core.multimodal.forward.MultimodalForward`) when set."""

    multimodal = True
    #: the class serving the checkpoint's language model alone (images refused): what tensor
    #: parallelism runs for a model whose vision tower is not sharded; None: refused there
    text_model: type | None = None

    @classmethod
    @abstractmethod
    def processor(cls, model_dir: str, config: dict, tokenizer) -> MultimodalProcessor:
        """The server-side processor, from the model directory's preprocessor files."""

    @abstractmethod
    def encode_images(self, items: list[ImageItem]) -> list[torch.Tensor]:
        """Each image's ``[num_tokens, hidden]`` input embeddings, in one batched encoder pass."""
