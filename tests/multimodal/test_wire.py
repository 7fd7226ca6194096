"""A request with images crosses the engine-process wire (msgpack) intact."""

from __future__ import annotations

import msgpack
import torch

from llmkit.core.engine.messages import GenerateRequest, SamplingParams, from_wire, to_wire
from llmkit.core.engine.request import Request
from llmkit.core.multimodal.items import ImageItem, MultimodalInputs, is_pseudo, pseudo_id


def test_images_round_trip_through_msgpack():
    pix = torch.randn(8, 12, dtype=torch.float32)
    item = ImageItem("ab" * 32, pix, 2, {"grid_thw": (1, 2, 4)})
    mm = MultimodalInputs([item], [(1, 2)], rope_positions=[[0, 1, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3]], rope_delta=-1)
    msg = GenerateRequest("r", [5, 9, 9, 6], SamplingParams(), mm=mm)
    back = from_wire(GenerateRequest, msgpack.unpackb(msgpack.packb(to_wire(msg)), raw=False))
    assert torch.equal(back.mm.items[0].pixel_values, pix) and back.mm.items[0].pixel_values.dtype == torch.float32
    assert back.mm.spans == [(1, 2)] and back.mm.rope_delta == -1 and back.mm.rope_positions == mm.rope_positions
    assert list(back.mm.items[0].meta["grid_thw"]) == [1, 2, 4] and back.prompt_ids == [5, 9, 9, 6]
    # the engine keys the image's tokens by its hash; the server's ids stay real
    req = Request.from_message(back, frozenset())
    assert req.prompt_ids == [5, pseudo_id(item.digest), pseudo_id(item.digest), 6] and is_pseudo(req.prompt_ids[1])
    other = Request.from_message(
        GenerateRequest(
            "s", [5, 9, 9, 6], SamplingParams(), mm=MultimodalInputs([ImageItem("cd" * 32, pix, 2)], [(1, 2)])
        ),
        frozenset(),
    )
    assert other.prompt_ids[1] != req.prompt_ids[1]
