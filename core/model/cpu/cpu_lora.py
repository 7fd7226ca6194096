"""LoRA adapter rows inside the C decoder stack (``cpu_decoder.c``'s ``lora_add``).

Through the Python layers an adapter costs a handful of small torch ops per projection and row
group (~200 projections a step on the embedded model), which outweighs the deltas' arithmetic; in
the C stack a row's delta is two vectorized loops. The stack reads half-precision copies of A and B
in blocks of 8 lanes (the layout ``cpu_decoder.c`` describes): at one row a step is bound by
reading them, and half the bytes is most of the adapter's cost gone. The stack runs only over
int8/int4 base weights, whose quantization error is far above fp16's rounding of A and B. Each
adapter keeps this copy beside its float32 weights (which the Python layers use), built the first
time the stack runs it.
"""

from __future__ import annotations

import ctypes

import torch

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# the stack's four linear layers of a block, in cpu_decoder.c's order
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
MAX_PARTS = 3  # Q, K and V of a fused QKV layer
MAX_RT = 3 * 256 + 8  # cpu_decoder.c's LORA_MAX_RT: wider adapters run in the Python layers
HALF_MAX = 65504.0  # the largest half-precision value: an adapter beyond it keeps the Python layers


class CLoRALin(ctypes.Structure):
    _fields_ = (
        [("at", _PTR), ("bt", _PTR)]
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


def _lanes(m: torch.Tensor) -> torch.Tensor:
    """``m [rows, cols]`` as half precision ``[ceil(rows / 8)][cols][8]`` (rows zero-padded)."""
    pad = -m.shape[0] % 8
    if pad:
        m = torch.cat([m, m.new_zeros(pad, m.shape[1])])
    return m.reshape(-1, 8, m.shape[1]).transpose(1, 2).contiguous().half()


def _half_lin(a: torch.Tensor, b: torch.Tensor, rank: int, parts: list) -> tuple[CLoRALin, list]:
    """One layer's ``CLoRALin`` over half-precision blocked copies of ``A [r_total, k]`` and
    ``B [n_out, r_total]`` (each part's B only: its rows, its rank columns)."""
    at = _lanes(a)
    blocks = [_lanes(b[d : d + n, p * rank : (p + 1) * rank]).flatten() for p, (d, n) in enumerate(parts)]
    offsets = [0]
    for blk in blocks[:-1]:
        offsets.append(offsets[-1] + blk.numel())
    bt = torch.cat(blocks)
    fields = [(_I64 * MAX_PARTS)(*v) for v in ([d for d, _ in parts], [n for _, n in parts], offsets)]
    return CLoRALin(at.data_ptr(), bt.data_ptr(), a.shape[0], rank, len(parts), *fields), [at, bt]


def _adapter_lins(adapter, nblocks: int):
    """The adapter's ``CLoRALin [nblocks * 4]`` (cached on it), or None where its weights cannot go
    (not float32 on the CPU, too wide, beyond half precision's range, or a layer outside the
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
            or max(a.abs().max().item(), b.abs().max().item()) > HALF_MAX
        ):
            adapter.native = (nblocks, None)
            return None
        lins[slot], held = _half_lin(a, b, adapter.rank, parts)
        keep += held
    adapter.native = (nblocks, lins, keep)
    return lins


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
