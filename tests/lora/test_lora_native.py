"""Adapter rows inside the C decoder stack (core/model/cpu/cpu_lora.py): a batch mixing two
adapters (one on every projection, one on parts of the fused layers) and a base row, prompts then
decode, gives the logits the Python layers give, and the stack did run the adapter rows."""

from __future__ import annotations

import pytest
import torch

from llmkit.core.lora.manager import LoRAManager
from llmkit.core.model import quantize
from llmkit.core.model.cpu import cpu_decoder
from llmkit.core.model.cpu.cpu_lora import quantize_rows

from lora_utils import ALL_TARGETS, save_adapter
from model_utils import load_ours, save_tiny_model
from paged_runner import PagedRunner

pytestmark = pytest.mark.skipif(not cpu_decoder.available(), reason="no C compiler: the Python layers run")

IDS = [(37 * i + 11) % 512 for i in range(40)]


def _scenario(model, lora: LoRAManager, adapters: list, native: bool) -> list[torch.Tensor]:
    model.native_stack, model._native_plan = native, False
    r = PagedRunner(model, 16)
    seqs = [r.new_seq() for _ in adapters]
    out = []

    def step(batch):
        active = lora.activate([adapters[i] for i, _ in batch], [len(t) for _, t in batch], torch.device("cpu"))
        out.extend(r.step([(seqs[i], t) for i, t in batch], lora=lora.batch if active else None))
        lora.deactivate()

    step([(0, IDS[:12])])  # one adapter alone: every row its group
    step([(0, [IDS[12]]), (1, IDS[:9]), (2, IDS[3:10])])  # a decode row beside two prompts
    for i in range(3):  # batched decode, three groups
        step([(k, [IDS[20 + 3 * i + k]]) for k in range(3)])
    return out


# The tiny model, and one whose K and V widths (12) are not a multiple of the stack's 8-lane blocks.
# The random adapters are strong (each adapted projection multiplies its input by ~5), so float
# rounding differences between the two paths grow layer by layer; the second model's adapters are
# scaled down (alpha) for the comparison to stay within 1e-4.
ODD_KV = {"num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 12}


@pytest.mark.parametrize("config,alpha", [({}, 16), (ODD_KV, 2)])
def test_mixed_adapter_batch_in_the_stack_equals_the_python_layers(tmp_path, monkeypatch, config, alpha):
    save_tiny_model("llama", tmp_path / "base", **config)
    save_adapter(tmp_path / "base", tmp_path / "all", seed=1, r=8, alpha=alpha, targets=ALL_TARGETS)
    save_adapter(
        tmp_path / "base", tmp_path / "some", seed=2, r=4, alpha=alpha // 2, targets=["k_proj", "up_proj", "o_proj"]
    )
    model = load_ours(tmp_path / "base")
    quantize.quantize(model, "int4", 32)  # the stack runs formats with a C kernel at every row count
    lora = LoRAManager(model, max_rank=64, max_per_batch=4)
    adapters = [lora.load("all", str(tmp_path / "all")), lora.load("some", str(tmp_path / "some")), None]
    for adapter in adapters[:2]:  # values the stack's int8 copies hold exactly (a row's scale each)
        for a, b in adapter.weights.values():
            for m in (a, b):
                q, scale = quantize_rows(m)
                m.copy_(q.float() * scale[:, None])
    runs = []
    real_run = cpu_decoder.NativeStack.run

    def counting_run(self, x, attend, lora=None):
        runs.append(lora is not None)
        return real_run(self, x, attend, lora)

    monkeypatch.setattr(cpu_decoder.NativeStack, "run", counting_run)
    got = _scenario(model, lora, adapters, True)
    assert runs == [True] * 5  # every forward had adapter rows, and the stack ran them
    ref = _scenario(model, lora, adapters, False)
    assert len(runs) == 5
    base = _scenario(model, lora, [None, None, None], True)
    for g, r, b in zip(got, ref, base):
        assert torch.allclose(g, r, atol=1e-4, rtol=1e-4), (g - r).abs().max()
    assert (got[0] - base[0]).abs().max() > 1e-2  # the adapters do change the logits
    assert torch.equal(got[-1], base[-1])  # the base row beside adapter rows: exactly the base model's


def test_weights_the_stack_cannot_take_keep_the_python_layers(tmp_path):
    """A bf16 adapter (a bf16 model's), or one with a value that is not finite, has no C copy:
    that forward runs the Python layers."""
    from llmkit.core.model.cpu.cpu_lora import NativeLoRA

    save_tiny_model("llama", tmp_path / "base")
    save_adapter(tmp_path / "base", tmp_path / "ad", seed=1, r=4)
    model = load_ours(tmp_path / "base")
    lora = LoRAManager(model, max_rank=64, max_per_batch=4)
    adapter = lora.load("ad", str(tmp_path / "ad"))
    lora.activate([adapter], [3], torch.device("cpu"))
    assert NativeLoRA.build(lora.batch, 3, len(model.layers)) is not None
    float32 = adapter.weights
    adapter.native = None
    adapter.weights = {k: (a.bfloat16(), b.bfloat16()) for k, (a, b) in float32.items()}
    assert NativeLoRA.build(lora.batch, 3, len(model.layers)) is None
    adapter.native = None  # float32, but an inf no int8 scale can hold
    first = next(iter(float32))
    adapter.weights = {k: (a, b * (float("inf") if k == first else 1.0)) for k, (a, b) in float32.items()}
    assert NativeLoRA.build(lora.batch, 3, len(model.layers)) is None
    adapter.native = None  # a large but finite adapter (past fp16's range) is scaled like any other
    adapter.weights = {k: (a, b * 1e6) for k, (a, b) in float32.items()}
    assert NativeLoRA.build(lora.batch, 3, len(model.layers)) is not None


def test_an_adapters_copies_share_one_buffer_in_the_stacks_order():
    """The int8 copies and their scales move into one buffer (huge pages from 2 MB), each on its own
    64-byte line, in the order the stack reads them, whatever order the layers came in."""
    import ctypes

    from llmkit.core.model.cpu import cpu_lora
    from llmkit.core.model.cpu.hugepages import HUGE

    g = torch.Generator().manual_seed(0)
    lins = (cpu_lora.CLoRALin * 3)()
    held = []
    for slot in (2, 0, 1):  # (not in order)
        a = torch.randn(16 + slot, 50000, generator=g)
        b = torch.randn(700, 16 + slot, generator=g)
        lins[slot], copies = cpu_lora._int8_lin(a, b, 16 + slot, [(0, 700)])
        held.append((slot, *copies))
    want = {slot: copies for slot, *copies in held}
    keep = cpu_lora._in_huge_pages(lins, held)
    buf = keep[0]
    start, end = buf.data_ptr(), buf.data_ptr() + buf.numel()
    if hasattr(__import__("mmap"), "MADV_HUGEPAGE"):
        assert start % HUGE == 0  # (a buffer over 2 MB)
    ptrs = [p for lin in lins for p in (lin.at, lin.bt, lin.as_, lin.bs)]
    assert ptrs == sorted(ptrs) and all(start <= p < end and p % 64 == 0 for p in ptrs)
    for slot, lin in enumerate(lins):
        for ptr, t in zip((lin.at, lin.bt, lin.as_, lin.bs), want[slot]):
            got = (ctypes.c_byte * (t.numel() * t.element_size())).from_address(ptr)
            assert bytes(got) == t.contiguous().view(torch.uint8).numpy().tobytes()
