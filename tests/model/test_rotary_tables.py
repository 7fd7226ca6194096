"""The rotary tables a forward indexes: in the activations' dtype, the rows equal the fp32 rows
cast (what a step indexed and cast before), and the cast tables are built once per dtype, so a
bf16 step indexes two tables and casts nothing."""

from __future__ import annotations

import torch

from llmkit.core.model.layers import RotaryEmbedding


def test_cast_tables_are_built_once_and_equal_the_cast_rows():
    rope = RotaryEmbedding(64, 512, {"rope_theta": 10000.0})
    positions = torch.tensor([0, 7, 511, 300])
    for dtype in (torch.bfloat16, torch.float16):
        cos2, sin2 = rope.table(positions, dtype)
        assert cos2.dtype == sin2.dtype == dtype and cos2.shape == (4, 1, 64)
        assert torch.equal(cos2, rope.cos2[positions].unsqueeze(1).to(dtype))
        assert torch.equal(sin2, rope.sin2[positions].unsqueeze(1).to(dtype))
        first = rope.tables(dtype)
        rope.table(positions, dtype)
        assert all(a is b for a, b in zip(first, rope.tables(dtype))), "the cast tables are kept"
    assert rope.tables(torch.float32)[0] is rope.cos2  # the fp32 tables themselves, no copy
