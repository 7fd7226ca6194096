"""The per-model half of image handling on the server side: pixels in, prompt tokens out."""

from __future__ import annotations

from abc import ABC, abstractmethod

from llmkit.core.multimodal.items import ImageItem, MultimodalInputs


class MultimodalProcessor(ABC):
    """Built once per server by the model plugin's ``processor`` classmethod.

    The chat template writes one placeholder per image (``{"type": "image"}`` content parts);
    :meth:`expand` replaces each with the image's run of tokens."""

    #: the token id the chat template writes for one image
    placeholder_id: int
    #: the text of that token, for prompts written by hand (``/generate`` with ``image_data``)
    placeholder_text: str
    #: the most pixels :meth:`preprocess` keeps of one image (None: not known); the default
    #: ``--max-image-pixels`` follows it
    max_pixels: int | None = None

    @abstractmethod
    def preprocess(self, image) -> ImageItem:
        """One decoded ``PIL.Image`` (RGB) as the model's pixels. Runs in a worker thread."""

    @abstractmethod
    def expand(self, ids: list[int], items: list[ImageItem]) -> tuple[list[int], MultimodalInputs]:
        """``ids`` with the i-th placeholder replaced by ``items[i]``'s tokens (real token ids:
        the engine swaps in pseudo-ids), and where each image sits. Raises ``ValueError`` when the
        prompt's placeholders and the images differ in number."""

    def target_size(self, width: int, height: int) -> tuple[int, int] | None:
        """The ``(width, height)`` :meth:`preprocess` resizes a ``width`` x ``height`` image to, so
        a large image is decoded and reduced toward it first; None: decoded at its full size."""
        return None
