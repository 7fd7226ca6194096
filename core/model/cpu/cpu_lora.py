"""LoRA adapter rows inside the C decoder stack (``cpu_decoder.c``'s ``lora_add``).

Through the Python layers an adapter costs a handful of small torch ops per projection and row
group (~200 projections a step on the embedded model), which outweighs the deltas' arithmetic; in
the C stack a row's delta is two vectorized loops. The stack reads int8 copies of A and B, a float
scale per row, in blocks of 8 lanes (the layout ``cpu_decoder.c`` describes): at one row a step is
bound by reading them, and a quarter of float32's bytes is most of the adapter's cost gone (as
llama.cpp serves q8_0 adapters). The stack runs only over int8/int4/GGUF base weights, whose own
rounding is far coarser than a per-row int8 copy of A and B (see :func:`quantize_rows`). Each
adapter keeps this copy beside its float32 weights (which the Python layers use), built the first
time the stack runs it.
"""

from __future__ import annotations

import ctypes

import torch

from llmkit.core.model.cpu.hugepages import HUGE, huge_empty

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# the stack's four linear layers of a block, in cpu_decoder.c's order
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
MAX_PARTS = 3  # Q, K and V of a fused QKV layer
MAX_RT = 3 * 256 + 8  # cpu_decoder.c's LORA_MAX_RT: wider adapters run in the Python layers


class CLoRALin(ctypes.Structure):
    _fields_ = (
        [("at", _PTR), ("bt", _PTR), ("as_", _PTR), ("bs", _PTR)]
        + [(n, _I64) for n in ("r_total", "rank", "nparts")]
        + [
            ("dst", _I64 * MAX_PARTS),
            ("len", _I64 * MAX_PARTS),
            ("boff", _I64 * MAX_PARTS),
        ]
    )


class CLoRAGroup(ctypes.Structure):
    _fields_ = [("nrows", _I64), ("rows", _PTR), ("lins", _PTR)]


class CLoRA(ctypes.Structure):
    _fields_ = [("ngroups", _I64), ("groups", _PTR)]


def quantize_rows(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``m [rows, cols]`` (float32) as int8 and a float32 scale per row (its largest magnitude
    over 127): ``m ~= q * scale[:, None]``, each value within half a step of its row's scale."""
    scale = m.abs().amax(dim=1) / 127.0
    q = torch.round(m / torch.where(scale > 0, scale, 1.0)[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _lanes(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``m [rows, cols]`` as int8 ``[ceil(rows / 8)][cols][8]`` (rows zero-padded) and the rows'
    scales ``[ceil(rows / 8) * 8]``."""
    pad = -m.shape[0] % 8
    if pad:
        m = torch.cat([m, m.new_zeros(pad, m.shape[1])])
    q, scale = quantize_rows(m)
    return q.reshape(-1, 8, m.shape[1]).transpose(1, 2).contiguous(), scale


def _int8_lin(a: torch.Tensor, b: torch.Tensor, rank: int, parts: list) -> tuple[CLoRALin, list]:
    """One layer's ``CLoRALin`` over int8 blocked copies of ``A [r_total, k]`` and
    ``B [n_out, r_total]`` (each part's B only: its rows, its rank columns); the pointers are set
    when the copies move to their buffer (:func:`_in_huge_pages`)."""
    at, a_scale = _lanes(a)
    blocks = [_lanes(b[d : d + n, p * rank : (p + 1) * rank]) for p, (d, n) in enumerate(parts)]
    offsets = [0]
    for q, _ in blocks[:-1]:
        offsets.append(offsets[-1] + q.numel())  # (its scales sit at offset / rank)
    bt = torch.cat([q.flatten() for q, _ in blocks])
    b_scale = torch.cat([sc for _, sc in blocks])
    fields = [(_I64 * MAX_PARTS)(*v) for v in ([d for d, _ in parts], [n for _, n in parts], offsets)]
    return CLoRALin(0, 0, 0, 0, a.shape[0], rank, len(parts), *fields), [at, bt, a_scale, b_scale]


def _adapter_lins(adapter, nblocks: int):
    """The adapter's ``CLoRALin [nblocks * 4]`` (cached on it), or None where its weights cannot go
    (not float32 on the CPU, too wide, not finite, or a layer outside the
    stack's four)."""
    cached = adapter.native
    if cached is not None:
        return cached[1] if cached[0] == nblocks else None
    lins, keep = (CLoRALin * (nblocks * 4))(), []
    names = {f"layers.{b}.{name}": b * 4 + i for b in range(nblocks) for i, name in enumerate(LINEARS)}
    for name, (a, b) in adapter.weights.items():
        slot = names.get(name)
        parts = adapter.parts.get(name, [])
        if (
            slot is None
            or a.dtype != torch.float32
            or a.device.type != "cpu"
            or not 0 < len(parts) <= MAX_PARTS
            or a.shape[0] + 7 > MAX_RT
            or not (torch.isfinite(a).all() and torch.isfinite(b).all())
        ):
            adapter.native = (nblocks, None)
            return None
        lins[slot], held = _int8_lin(a, b, adapter.rank, parts)
        keep.append((slot, *held))
    adapter.native = (nblocks, lins, _in_huge_pages(lins, keep))
    return lins


def _in_huge_pages(lins, held: list) -> list:
    """Move every layer's copies (int8 and scales) into one buffer in huge pages, in the stack's
    order of use, and point ``lins`` there. Why: a step reads the whole adapter in ~120 short
    runs, each starting on pages its TLB has not seen (~1,200 of 4 KB a step for a rank-16
    adapter of the 135M model)."""
    held.sort(key=lambda h: h[0])
    size = sum(_aligned(t.numel() * t.element_size()) for _, *ts in held for t in ts)
    buf = huge_empty((size,), torch.uint8, min_bytes=HUGE)
    at = 0
    for slot, *ts in held:
        ptrs = []
        for t in ts:
            raw = t.contiguous().flatten().view(torch.uint8)
            buf[at : at + raw.numel()] = raw
            ptrs.append(buf[at:].data_ptr())
            at += _aligned(raw.numel())
        lins[slot].at, lins[slot].bt, lins[slot].as_, lins[slot].bs = ptrs
    return [buf]


def _aligned(n: int) -> int:
    return -(-n // 64) * 64  # each copy starts on a 64-byte line


class NativeLoRA:
    """One forward's adapter groups as the C stack reads them; ``address`` is its pointer."""

    def __init__(self, groups: list, keep: list) -> None:
        self._groups = (CLoRAGroup * len(groups))(*groups)
        self._keep = keep
        self._lora = CLoRA(len(groups), ctypes.addressof(self._groups))
        self.address = ctypes.addressof(self._lora)

    @classmethod
    def build(cls, batch, rows: int, nblocks: int) -> "NativeLoRA | None":
        """``batch`` (a ``LoRABatch``) for a forward of ``rows`` rows, or None where an adapter's
        weights cannot go into the stack (the Python layers run that forward)."""
        groups, keep = [], []
        for adapter, idx in batch.groups:
            lins = _adapter_lins(adapter, nblocks)
            if lins is None:
                return None
            if idx is None:
                groups.append(CLoRAGroup(rows, None, ctypes.addressof(lins)))
            else:
                idx = idx.to(device="cpu", dtype=torch.int64).contiguous()
                keep.append(idx)
                groups.append(CLoRAGroup(idx.numel(), idx.data_ptr(), ctypes.addressof(lins)))
            keep.append(lins)
        return cls(groups, keep)
