"""Every tensor an attention backend's metadata builds sits on the batch's device.

A tensor made without ``device=`` lands on the default device, the CPU, which a CPU run cannot tell
apart from the right one: on CUDA the torch backend's ``q_rows`` (a bare ``torch.tensor``) met a
CUDA query in ``index_select`` and crashed every batch that mixed prompt and decode rows. Here the
metadata is built with the *default* device set to ``meta``, so any tensor that forgot its device
lands there and the check names it."""

from __future__ import annotations

import pytest
import torch

from llmkit.plugins.attention import cpu_attention
from llmkit.plugins.attention.torch_backend import TorchAttentionBackend

from attention_utils import backend_kwargs, build_batch

MIXED = [(5, 3), (7, 1), (0, 4), (9, 1)]  # prompt rows beside decode rows
DECODE = [(6, 1), (11, 1)]
NATIVE = cpu_attention.available(torch.float32, torch.device("cpu"))


def _tensors(obj, path="extra"):
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}[{i}]")
    elif hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            yield from _tensors(v, f"{path}.{k}")


@pytest.mark.parametrize("seqs", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize(
    "native", [pytest.param(True, marks=pytest.mark.skipif(not NATIVE, reason="no C kernel here")), False]
)
def test_torch_backend_metadata_on_the_batch_device(seqs, native):
    b = build_batch(seqs, num_heads=4, num_kv_heads=2, head_dim=16, page_size=4)
    backend = TorchAttentionBackend(**backend_kwargs(b, 4))
    backend._native = native  # the C kernel's metadata, or the padded-GEMM path's
    b.md.extra.clear()
    with torch.device("meta"):
        md = backend.prepare_metadata(b.md)
    found = list(_tensors(md.extra))
    assert found
    wrong = [(p, t.device) for p, t in found if t.device != b.q.device]
    assert not wrong, wrong
    # and the forward runs on them (on CUDA this was the crash)
    out = backend.forward(b.q, b.k, b.v, 0, md)
    assert out.shape[0] == b.q.shape[0] and torch.isfinite(out).all()
