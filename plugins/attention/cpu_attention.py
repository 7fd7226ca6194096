"""The C attention kernel (``cpu_attention.c``) behind a torch-shaped call."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from llmkit.core import native

_SOURCE = Path(__file__).with_name("cpu_attention.c")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # anything else one byte, via a table

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _lib():
    args = [_PTR, _I64, _PTR, _PTR, ctypes.c_int, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR]
    args += [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_int, _PTR, _PTR]
    return native.load(
        _SOURCE,
        paged_attention=args + [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR],
        attend_step=[_PTR, _I64, _PTR, _I64, _PTR],
    )


class _AttendStep(ctypes.Structure):  # cpu_attention.c's AttendStep
    _fields_ = [("k", _PTR), ("v", _PTR)] + [(n, ctypes.c_int) for n in ("kv_dtype", "H", "Hkv", "D")]
    _fields_ += [(n, _I64) for n in ("k_slot", "k_head", "v_slot", "v_head")]
    _fields_ += [(n, _PTR) for n in ("table", "rows", "lens", "out_slots")]
    _fields_ += [(n, _I64) for n in ("table_stride", "B", "T")]
    _fields_ += [("cos2", _PTR), ("sin2", _PTR), ("scale", ctypes.c_float), ("qrot", _PTR)]


def layer_ptrs(buffers: list[torch.Tensor]) -> ctypes.Array:
    """The per-layer pool buffers' addresses, as :func:`attend_step` takes them."""
    return (_PTR * len(buffers))(*(b.data_ptr() for b in buffers))


@functools.cache
def _byte_table(dtype: torch.dtype) -> torch.Tensor:
    """fp32 value of each byte of a one-byte float dtype (fp8)."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).float()


def available(pool_dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and (pool_dtype in _DTYPES or pool_dtype.itemsize == 1) and _lib() is not None


def stores(pool_dtype: torch.dtype, k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor) -> bool:
    """Whether :func:`paged_attention` can write these new keys and values itself: fp32 rows of
    contiguous heads, int64 slots, into a 16- or 32-bit pool."""
    rows_ok = all(
        t is None or (t.dtype == torch.float32 and t.stride(2) == 1 and t.stride(1) == t.shape[2]) for t in (k, v)
    )
    return pool_dtype in _DTYPES and slots.dtype == torch.int64 and rows_ok


def paged_attention(
    q, kbuf, vbuf, table, rows, lens, *, scale, window, sinks, v_head_dim, new_kv=None, rope=None
) -> torch.Tensor:
    """``q [B, H, D]`` (fp32; B query rows), row b over the first ``lens[b]`` keys of the sequence at
    ``table[rows[b]]`` -> ``[B, H, Dv]``.
    ``vbuf`` None: the values are the keys' first ``v_head_dim`` channels (a latent cache).
    ``new_kv``: ``(k, v, slots)`` to write to the pool first (see :func:`stores`), in the same call.
    ``rope``: ``(cos2, sin2)`` contiguous ``[B, D]`` fp32 tables (a :class:`RotaryEmbedding` table's
    rows): ``q`` and the new keys are not rotated yet, and are rotated here as ``rotate`` would."""
    b, h, d = q.shape
    hkv = kbuf.shape[1]
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    out = q.new_empty(b, h, v_head_dim)
    k_new, v_new, slots = new_kv if new_kv is not None else (None, None, None)
    cos2, sin2 = rope if rope is not None else (None, None)
    qrot = None if rope is None else q.new_empty(b, h, d)
    code = _DTYPES.get(kbuf.dtype, 3)
    lut = _byte_table(kbuf.dtype) if code == 3 else None
    values = kbuf if vbuf is None else vbuf
    _lib().paged_attention(
        q.data_ptr(),
        q.stride(0),
        kbuf.data_ptr(),
        values.data_ptr(),
        code,
        None if lut is None else lut.data_ptr(),
        kbuf.stride(0),
        kbuf.stride(1),
        values.stride(0),
        values.stride(1),
        table.data_ptr(),
        table.stride(0),
        rows.data_ptr(),
        lens.data_ptr(),
        b,
        h,
        hkv,
        d,
        v_head_dim,
        scale,
        window or 0,
        None if sinks is None else sinks.data_ptr(),
        out.data_ptr(),
        None if k_new is None else k_new.data_ptr(),
        0 if k_new is None else k_new.stride(0),
        None if v_new is None else v_new.data_ptr(),
        0 if v_new is None else v_new.stride(0),
        None if slots is None else slots.data_ptr(),
        0 if k_new is None else k_new.shape[0],
        None if cos2 is None else cos2.data_ptr(),
        None if sin2 is None else sin2.data_ptr(),
        None if qrot is None else qrot.data_ptr(),
    )
    return out


def attend_step(pool, ptrs: tuple, native: dict, slots, rope, heads: int, scale: float):
    """A :class:`~llmkit.core.model.cpu_decoder.NativeAttend` running ``attend_step`` (this
    forward's rows, slots and rotary tables ``(cos2, sin2) [T, D]``) over the per-layer pools
    (``ptrs``: :func:`layer_ptrs` of the pool's K and V buffers)."""
    from llmkit.core.model.cpu.cpu_decoder import NativeAttend

    k0, v0 = pool.k_buffers[0], pool.v_buffers[0]
    kp, vp = ptrs
    cos2, sin2 = rope
    t, d = cos2.shape
    rows, lens, table = native["rows"], native["lens"], native["table"]
    b = rows.shape[0]
    qrot = torch.empty(b * heads * d)
    step = _AttendStep(
        ctypes.addressof(kp),
        ctypes.addressof(vp),
        _DTYPES[k0.dtype],
        heads,
        k0.shape[1],
        d,
        k0.stride(0),
        k0.stride(1),
        v0.stride(0),
        v0.stride(1),
        table.data_ptr(),
        rows.data_ptr(),
        lens.data_ptr(),
        slots.data_ptr(),
        table.stride(0),
        b,
        t,
        cos2.data_ptr(),
        sin2.data_ptr(),
        scale,
        qrot.data_ptr(),
    )
    fn = ctypes.cast(_lib().attend_step, _PTR).value
    return NativeAttend(fn, ctypes.addressof(step), (step, kp, vp, rows, lens, table, slots, cos2, sin2, qrot))
