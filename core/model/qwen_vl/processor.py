"""The Qwen vision-language processor: pixels, placeholders and M-RoPE positions."""

from __future__ import annotations

import hashlib

from llmkit.core.model.qwen_vl.config import text_config
from llmkit.core.multimodal.items import ImageItem, MultimodalInputs
from llmkit.core.multimodal.processor import MultimodalProcessor


class QwenVLProcessor(MultimodalProcessor):
    """Pixels by transformers' ``Qwen2VLImageProcessor`` (resized to multiples of 2 patches,
    flattened into patch x patch x 2-frame rows in 2x2-block order); one ``<|image_pad|>`` per
    merged 2x2 block; M-RoPE positions as transformers' ``get_rope_index`` lays them out for images
    (the same for Qwen2-VL, Qwen2.5-VL and Qwen3-VL)."""

    def __init__(self, image_processor, config: dict, tokenizer=None):
        config = text_config(config)
        self.image_processor = image_processor
        vc = config.get("vision_config") or {}
        self.merge = int(vc.get("spatial_merge_size", getattr(image_processor, "merge_size", 2)))
        self.placeholder_id = int(config["image_token_id"])
        text = None
        if tokenizer is not None:
            text = tokenizer.convert_ids_to_tokens(self.placeholder_id)
        self.placeholder_text = text or "<|image_pad|>"
        # transformers 5 keeps the pixel range in size (longest_edge: max_pixels), 4 as attributes
        size = getattr(image_processor, "size", None) or {}
        self._pixel_range = (
            int(size.get("shortest_edge") or getattr(image_processor, "min_pixels", 56 * 56)),
            int(size.get("longest_edge") or getattr(image_processor, "max_pixels", 28 * 28 * 1280)),
        )
        self.max_pixels = self._pixel_range[1]

    def target_size(self, width: int, height: int) -> tuple[int, int] | None:
        ip = self.image_processor
        if not getattr(ip, "do_resize", True):
            return None
        try:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
        except ImportError:  # transformers 4
            from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
        factor = int(getattr(ip, "patch_size", 14)) * int(getattr(ip, "merge_size", self.merge))
        try:
            h, w = smart_resize(height, width, factor, *self._pixel_range)
        except ValueError:  # an aspect ratio it refuses: preprocess says so
            return None
        return w, h

    def preprocess(self, image) -> ImageItem:
        out = self.image_processor(images=[image], return_tensors="pt")
        pixels = out["pixel_values"].contiguous()
        t, h, w = (int(v) for v in out["image_grid_thw"][0])
        digest = hashlib.sha256(pixels.numpy().tobytes() + f"|{t},{h},{w}".encode()).hexdigest()
        return ImageItem(digest, pixels, t * h * w // self.merge**2, {"grid_thw": (t, h, w)})

    def expand(self, ids: list[int], items: list[ImageItem]) -> tuple[list[int], MultimodalInputs]:
        where = [i for i, tok in enumerate(ids) if tok == self.placeholder_id]
        if len(where) != len(items):
            raise ValueError(f"the prompt has {len(where)} image placeholders for {len(items)} images")
        if not items:
            return list(ids), MultimodalInputs([], [])
        out: list[int] = []
        spans: list[tuple[int, int]] = []
        axes: list[list[int]] = [[], [], []]
        pos, prev = 0, 0  # the next text position; the end of the last placeholder in ``ids``

        def text(n: int) -> None:
            nonlocal pos
            for a in axes:
                a.extend(range(pos, pos + n))
            pos += n

        for at, item in zip(where, items):
            out.extend(ids[prev:at])
            text(at - prev)
            t, h, w = item.meta["grid_thw"]
            gh, gw = h // self.merge, w // self.merge
            spans.append((len(out), item.num_tokens))
            out.extend([self.placeholder_id] * item.num_tokens)
            for ti in range(t):
                for r in range(gh):
                    axes[0].extend([pos + ti] * gw)
                    axes[1].extend([pos + r] * gw)
                    axes[2].extend(range(pos, pos + gw))
            pos += max(gh, gw)  # as transformers: the text after an image continues past its grid
            prev = at + 1
        out.extend(ids[prev:])
        text(len(ids) - prev)
        delta = max(max(a) for a in axes) + 1 - len(out)
        return out, MultimodalInputs(list(items), spans, rope_positions=axes, rope_delta=delta)
