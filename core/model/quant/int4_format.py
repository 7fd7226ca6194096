"""``int4``: 4-bit weights in groups along the input dimension, each group with a scale and a zero.

A weight is ``(q - 8) * scale + zero`` with ``q`` in 0..15 and one ``(scale, zero)`` per ``group``
input columns. GGUF Q4_0 / Q4_1 / Q4_K (group 32), GPTQ and AWQ (group 128) map onto it without
requantizing; a dense checkpoint is quantized at load (asymmetric min/max per group,
``--quantization int4``). No dense copy stays resident.

Kernels, measured on the project's 2-core VM (README, ``benchmarks/bench_kernels.py``):
- our C kernel (:mod:`llmkit.core.model.cpu.cpu_quant`, llama.cpp's Q4 x Q8 integer scheme) where it
  builds: a decode step's int4 layers, weights streaming from memory, 1.4-1.6x torch's at one row
  and 2-3.2x from 16 to 512 rows with AVX512-VNNI (1.2-1.5x with AVX2 alone). The layer is packed
  in its layout (:func:`cpu_quant.q4_pack`).
- otherwise torch's ``_weight_int4pack_mm_for_cpu`` with bf16 activations, in its packed layout
  (``_convert_weight_to_int4pack_for_cpu``, torch 2.5+): output rows in blocks of ``B`` (64, or 32
  in torch 2.13's build here: probed once, :func:`_torch_block`); block ``b`` is ``[in, B/2]``
  bytes whose byte ``j`` holds rows ``Bb + j`` (low nibble) and ``Bb + B/2 + j`` (high).
  :func:`unpack_int4` inverts it.
Either runs at every row count: both beat dequantizing for the call, and a row's result does not
depend on how many rows the call has, so deterministic mode runs them as is.

On CUDA a layer is packed on the device for the Triton w4a16 kernel
(:mod:`llmkit.core.model.quant.int4_triton`: int32 words ``[in/8, out]``, fp16/bf16 scales and zeros
``[in/group, out]``) and multiplied by it at every row count, activations in the model dtype;
deterministic mode runs it with one tile configuration for every row count. Only the packed
buffers stay resident there too.
"""

from __future__ import annotations

import functools

import torch

from llmkit.core.model.cpu import cpu_quant
from llmkit.core.model.linear import WeightFormat, dense_linear

# Rows per call up to which the int4 kernel runs; above it the weight is dequantized for the call.
# Measured (benchmarks/bench_kernels.py, README): the kernel beats dequantize-then-fp32-GEMM at every
# row count here (at 512 rows it is within ~5 % of the fp32 GEMM, and dequantizing costs more), so
# there is no limit; benchmarks lower it to time the dequantizing path.
INT4_MAX_ROWS = 1 << 30
_BLOCK_N = 64  # layers are padded to a multiple of it: of the CPU packing's row block (64 or 32)
# Devices whose layers run the Triton kernel. Tests add "cpu" to run it under Triton's interpreter.
TRITON_DEVICES = ("cuda",)


def _int4_triton():
    """The Triton kernel's module: int4 weights on CUDA have no other kernel, and triton is an extra."""
    try:
        from llmkit.core.model.quant import int4_triton
    except ImportError as exc:
        raise RuntimeError(
            f"int4 weights on CUDA run a Triton kernel, and triton cannot be imported ({exc}): "
            "pip install 'llmkit[triton]'"
        ) from None
    return int4_triton


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization of ``w [out, in]`` per ``group`` columns: ``(q uint8 0..15,
    scale [out, in/group], zero [out, in/group])`` with ``w ~= (q - 8) * scale + zero``."""
    out, k = w.shape
    g = w.detach().float().reshape(out, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.reshape(out, k), scale, lo + 8 * scale


_LOAD_ROWS = 8192  # rows of an already 4-bit source unpacked per call
_PACK_ROWS = 4096  # rows packed per call: the kernel's packing takes int32 (4 bytes a value)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` (values 0..15, N a multiple of 64) into the CPU kernel's packed layout.

    Each 64-row block packs on its own, so the rows go through in chunks of ``_PACK_ROWS``: the
    int32 copy the packing takes is then at most 16 MB a 1,000 columns, not 4 bytes for every value
    (2.1 GB for a 128k x 4096 embedding table)."""
    if q.shape[0] <= _PACK_ROWS:
        return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    out = torch.empty(q.shape[0], q.shape[1] // 2, dtype=torch.uint8)
    for lo in range(0, q.shape[0], _PACK_ROWS):
        hi = min(lo + _PACK_ROWS, q.shape[0])
        out[lo:hi] = torch._convert_weight_to_int4pack_for_cpu(q[lo:hi].to(torch.int32).contiguous(), 1)
    return out


@functools.lru_cache(maxsize=None)
def _torch_block() -> int:
    """Rows per block of torch's CPU int4 packing, read off a probe: 64 where it was written
    against, 32 in torch 2.13 here (where row 16's value lands in byte 0's high nibble)."""
    q = torch.zeros(64, 2, dtype=torch.int32)
    q[16, 0] = 1
    first = torch._convert_weight_to_int4pack_for_cpu(q, 1).view(-1)[0].item()
    return 32 if first >> 4 == 1 else 64


def unpack_int4(packed: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The ``q`` values ``[N, K]`` (uint8) of a packed weight, or only those of ``rows``."""
    n, k = packed.shape[0], packed.shape[1] * 2
    block = _torch_block()
    half = block // 2
    blocks = packed.view(n // block, k, half)
    if rows is None:
        out = torch.empty(n // block, 2, half, k, dtype=torch.uint8)
        by_row = blocks.transpose(1, 2)  # [nb, B/2, K]
        torch.bitwise_and(by_row, 15, out=out[:, 0])
        torch.bitwise_right_shift(by_row, 4, out=out[:, 1])
        return out.view(n, k)
    b, j = rows // block, rows % block
    byte = blocks[b, :, j % half]  # [r, K]
    return torch.where((j >= half)[:, None], byte >> 4, byte & 15)


DEFAULT_GROUP = 32  # --quantization-group-size when not given (llama.cpp's Q4_0 block)


class Int4Format(WeightFormat):
    """Weight-only int4 in groups of ``group`` input columns, through ``_weight_int4pack_mm_for_cpu``."""

    name = "int4"

    def __init__(self, group: int = DEFAULT_GROUP) -> None:
        if group not in (32, 64, 128, 256):
            raise ValueError(f"int4 group size {group} is not one of 32, 64, 128, 256")
        self.group = group

    @classmethod
    def for_quantization(cls, group_size: int | None) -> "Int4Format":
        return cls(group_size or DEFAULT_GROUP)

    def for_features(self, in_features: int) -> "Int4Format":
        """This format, or the one with the largest smaller group that divides ``in_features``
        (``--quantization-group-size 128`` on a 576-wide layer quantizes it in groups of 64)."""
        for group in (self.group, 128, 64, 32):
            if group <= self.group and in_features % group == 0:
                return self if group == self.group else Int4Format(group)
        raise ValueError(f"int4 needs input features divisible by 32; a layer has {in_features}")

    def create(self, layer, out_features: int, in_features: int) -> None:
        if in_features % self.group:
            raise ValueError(f"int4 group size {self.group} does not divide the layer's {in_features} input features")
        device = device_of(layer)
        layer.weight = None
        n = -(-out_features // _BLOCK_N) * _BLOCK_N
        # Staging until finalize(), on the layer's device: the unpacked values (1 byte each),
        # scales and zeros.
        layer._q4 = torch.full((n, in_features), 8, dtype=torch.uint8, device=device)
        layer._q4_scale = torch.zeros(n, in_features // self.group, device=device)
        layer._q4_zero = torch.zeros(n, in_features // self.group, device=device)

    def load(self, layer, src, dst_rows: slice, src_rows: slice, src_cols: slice) -> None:
        if src_cols.start % self.group or (src_cols.stop - src_cols.start) % self.group:
            raise ValueError(f"a column slice {src_cols} of an int4 weight must align with its {self.group}-groups")
        if hasattr(src, "int4_groups"):  # already 4-bit (GGUF Q4_*, GPTQ, AWQ): no requantization
            if src.group != self.group:
                raise ValueError(f"int4 source group {src.group} != layer group {self.group}")
            # in row chunks: unpacking takes several 1-4 byte copies of every value (a 128k x 4096
            # GGUF table's took ~1.5 GB at once)
            start, stop = src_rows.start or 0, src_rows.stop
            for lo in range(start, stop, _LOAD_ROWS):
                hi = min(lo + _LOAD_ROWS, stop)
                q, scale, zero = src.int4_groups(slice(lo, hi), src_cols)
                rows = slice(dst_rows.start + lo - start, dst_rows.start + hi - start)
                layer._q4[rows].copy_(q)
                layer._q4_scale[rows].copy_(scale)
                layer._q4_zero[rows].copy_(zero)
            return
        if getattr(layer, "in_perm", None) is not None:  # a dense source is in natural column order
            layer.in_perm = None
        w = src.dequantize() if hasattr(src, "dequantize") else src
        q, scale, zero = quantize_int4(w[src_rows, src_cols], self.group)
        layer._q4[dst_rows].copy_(q)
        layer._q4_scale[dst_rows].copy_(scale)
        layer._q4_zero[dst_rows].copy_(zero)

    def take_staged(self, layer) -> torch.Tensor:
        r = layer.local_out
        w = self._groups_to_dense(layer._q4[:r], layer._q4_scale[:r], layer._q4_zero[:r])
        layer._q4 = layer._q4_scale = layer._q4_zero = None
        return w

    def finalize(self, layer) -> None:
        if getattr(layer, "_q4", None) is None:
            return
        # packed for the kernel that will run it (see the module docstring)
        layer.q4_triton = layer._q4.device.type in TRITON_DEVICES
        layer.q4_native = not layer.q4_triton and layer._q4.device.type == "cpu" and cpu_quant.available()
        if layer.q4_triton:
            int4_triton = _int4_triton()
            n = layer.local_out
            packed, sz = int4_triton.pack(layer._q4[:n], layer._q4_scale[:n], layer._q4_zero[:n])
        elif layer.q4_native:
            scale, zero = layer._q4_scale, layer._q4_zero
            packed, sz = cpu_quant.q4_pack(layer._q4, scale, zero, sym=cpu_quant.symmetric(scale, zero))
        else:
            packed = pack_int4(layer._q4)
            # [in/group, N, 2] bf16: the kernel takes scales and zeros in the activation dtype.
            sz = torch.stack((layer._q4_scale, layer._q4_zero), dim=-1).transpose(0, 1).contiguous()
            sz = sz.to(torch.bfloat16)
        layer.register_buffer("q4_packed", packed, persistent=False)
        layer.register_buffer("q4_scale_zero", sz, persistent=False)
        layer._q4 = layer._q4_scale = layer._q4_zero = None

    def apply(self, layer, x, deterministic):
        n = layer.local_out
        b = layer._buffers  # (not nn.Module.__getattr__: ~0.6 us a lookup, 3 per call)
        perm = b["in_perm"]
        if layer.q4_triton:
            if perm is not None:  # GPTQ act order: the columns are stored sorted by group
                x = x.index_select(1, perm)
            return self._triton(x, b["q4_packed"], b["q4_scale_zero"], self.group, deterministic)
        if perm is None and layer.q4_native and x.dtype == torch.float32 and x.shape[0] <= INT4_MAX_ROWS:
            return cpu_quant.q4_linear(x, b["q4_packed"], b["q4_scale_zero"], self.group, n)
        if perm is not None:  # GPTQ act order: the columns are stored sorted by group
            x = x.index_select(1, perm)
        if x.shape[0] <= INT4_MAX_ROWS:
            # Its rows do not depend on the row count (tests/model/quant/test_gguf_quant.py), so deterministic
            # mode runs it too.
            y = self._kernel(layer, x)
            return y if y.shape[1] == n else y[:, :n]  # drop the padding rows of the last 64-block
        return dense_linear(x, self._dequantize(layer).to(x.dtype), None, deterministic)

    @staticmethod
    def _triton(x, packed, scale_zero, group, deterministic):
        from llmkit.core.model.quant.int4_triton import w4a16_linear

        return w4a16_linear(x, packed, scale_zero, group, deterministic)

    def _kernel(self, layer, x):
        # Decode runs this ~120 times a step, so the cheap spellings: buffers from ``_buffers``
        # and .bfloat16()/.float() (~1 us less argument parsing than .to(dtype); same conversions).
        b = layer._buffers
        if layer.q4_native:
            y = cpu_quant.q4_linear(x, b["q4_packed"], b["q4_scale_zero"], self.group, layer.local_out)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        y = torch._weight_int4pack_mm_for_cpu(x.bfloat16(), b["q4_packed"], self.group, b["q4_scale_zero"])
        return y.float() if x.dtype == torch.float32 else y.to(x.dtype)

    def dense_weight(self, layer) -> torch.Tensor:
        """The dequantized fp32 weight ``[out, in]``, from the packed buffers."""
        w = self._dequantize(layer)
        perm = getattr(layer, "in_perm", None)
        return w if perm is None else torch.empty_like(w).index_copy_(1, perm, w)

    def _dequantize(self, layer, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The stored weight (columns in stored order) dequantized to fp32, or its ``rows``."""
        if layer.q4_triton:
            from llmkit.core.model.quant import int4_triton

            q, scale, zero = int4_triton.unpack(layer.q4_packed, layer.q4_scale_zero, rows)
        elif layer.q4_native:
            q, scale, zero = cpu_quant.q4_unpack(layer.q4_packed, layer.q4_scale_zero, rows)
        else:
            q = unpack_int4(layer.q4_packed, rows)
            sz = layer.q4_scale_zero.float()
            sz = sz[:, : layer.local_out] if rows is None else sz[:, rows]
            scale, zero = sz[..., 0].t(), sz[..., 1].t()
        r = q.shape[0] if rows is not None else layer.local_out
        return self._groups_to_dense(q[:r], scale[:r], zero[:r])

    def _groups_to_dense(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """``(q - 8) * scale + zero`` per group: fp32 ``[R, K]`` from ``q [R, K]`` uint8 and
        ``scale``/``zero [R, K/group]``."""
        r, k = q.shape
        w = torch.mul(q.view(r, k // self.group, self.group), scale[..., None])  # uint8 x fp32 -> fp32
        w.add_((zero - 8 * scale)[..., None])
        return w.view(r, k)

    def embed(self, layer, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self._dequantize(layer, flat).view(*ids.shape, -1)


def device_of(layer) -> torch.device:
    """Where a layer's weight lives: its dense weight's device before conversion, else its staging's
    or packed buffer's, else its bias's; the default device (``with torch.device(...)`` while a
    model is built) for a layer with none yet."""
    for name in ("weight", "_q4", "q4_packed", "bias"):
        t = getattr(layer, name, None)
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.get_default_device()
