"""Images across the engine-process wire (msgpack): tensors as dtype, shape and raw bytes."""

from __future__ import annotations

import torch

from llmkit.core.multimodal.items import ImageItem, MultimodalInputs


def _tensor_to_wire(t: torch.Tensor) -> dict:
    t = t.detach().cpu().contiguous()
    raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": raw.numpy().tobytes()}


def _tensor_from_wire(d: dict) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(d["data"]), dtype=torch.uint8)
    return flat.view(getattr(torch, d["dtype"])).reshape(d["shape"])


def mm_to_wire(mm: MultimodalInputs) -> dict:
    return {
        "items": [
            {"digest": i.digest, "pixels": _tensor_to_wire(i.pixel_values), "num_tokens": i.num_tokens, "meta": i.meta}
            for i in mm.items
        ],
        "spans": [list(s) for s in mm.spans],
        "rope_positions": mm.rope_positions,
        "rope_delta": mm.rope_delta,
        "bidirectional": mm.bidirectional,
    }


def mm_from_wire(d: dict) -> MultimodalInputs:
    items = [
        ImageItem(i["digest"], _tensor_from_wire(i["pixels"]), int(i["num_tokens"]), dict(i["meta"]))
        for i in d["items"]
    ]
    return MultimodalInputs(
        items=items,
        spans=[(int(a), int(b)) for a, b in d["spans"]],
        rope_positions=d["rope_positions"],
        rope_delta=int(d["rope_delta"]),
        bidirectional=bool(d["bidirectional"]),
    )
