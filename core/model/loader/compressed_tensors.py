"""compressed-tensors checkpoints (``quant_method: compressed-tensors``): the format llm-compressor
writes, and most RedHatAI and NVIDIA quantizations on the Hub.

Weight-only formats, per linear layer ``X``:

- ``pack-quantized`` (W4A16 and the like): ``X.weight_packed`` int32 ``[out, ceil(in * bits / 32)]``,
  the values offset by ``2 ** (bits - 1)`` and packed densely along the input dim (value ``j`` of a
  word in bits ``bits * j ...``); ``X.weight_scale`` ``[out, groups]`` (``group`` strategy) or
  ``[out, 1]`` (``channel``); with asymmetric quantization ``X.weight_zero_point``, packed the same
  way along the output dim; ``X.weight_shape``; ``X.weight_g_idx`` under activation order.
  ``w = (q - zero_point) * scale``. 4-bit ones load onto :class:`Int4Format` as they are (a channel
  scale repeated over groups of 128, 64 or 32 columns): ``w = (u - 8) * s + z`` with ``u = q + 8``,
  ``z = -zero_point * s``. Other bit widths are dequantized.
- ``int-quantized`` / ``naive-quantized`` (W8A16, W8A8): ``X.weight`` int8 and ``X.weight_scale``;
- ``float-quantized`` (FP8 W8A8 / W8A16): ``X.weight`` float8_e4m3 and ``X.weight_scale`` per
  tensor, per channel (``[out, 1]``) or per block (``[out / b0, in / b1]``).
  Both dequantized to the compute dtype at load (logged), matching the checkpoint's dequantized
  weights exactly; ``--quantization int8`` then puts them on the int8 kernel.

Activation quantization (``input_activations``: static or dynamic scales for W8A8) is not applied:
activations stay in the compute dtype, as on a W8A16 checkpoint (logged). Layers in ``ignore``
keep dense tensors in the file, which pass through.
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator

import torch

from llmkit.core.model.loader.int4_checkpoints import PackedInt4Tensor, quant_method

log = logging.getLogger("llmkit")

METHOD = "compressed-tensors"
FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
_LEAVES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "weight")
_DROPPED = ("input_scale", "input_zero_point", "output_scale", "output_zero_point", "weight_global_scale")


def checkpoint_quantization(hf_config: dict) -> str | None:
    """The checkpoint's quantization method the loaders read: ``compressed-tensors`` (checked
    here), ``gptq``/``awq``, or None for a dense checkpoint; fails for others."""
    qc = hf_config.get("quantization_config") or {}
    if str(qc.get("quant_method", "")).lower() == METHOD:
        weight_args(hf_config)
        return METHOD
    return quant_method(hf_config)


def weight_args(hf_config: dict) -> dict:
    """The checkpoint's weight quantization arguments (every config group must quantize weights
    alike); a format or strategy this loader does not read fails here, naming it."""
    qc = hf_config["quantization_config"]
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    fmt = {g.get("format") or qc.get("format") for g in groups}
    if len(fmt) != 1 or not fmt <= set(FORMATS):
        raise ValueError(f"compressed-tensors format {sorted(map(str, fmt))} is not supported; supported: {FORMATS}")
    args = [g.get("weights") or {} for g in groups]
    if any(a != args[0] for a in args):
        raise ValueError("compressed-tensors config groups that quantize weights differently are not supported")
    a = dict(args[0], format=fmt.pop())
    if a.get("strategy") not in ("group", "channel", "tensor", "block"):
        raise ValueError(f"compressed-tensors weight strategy '{a.get('strategy')}' is not supported")
    if a.get("type", "int") not in ("int", "float"):
        raise ValueError(f"compressed-tensors weight type '{a.get('type')}' is not supported; supported: int, float")
    if a.get("strategy") == "block" and a["format"] == "pack-quantized":
        raise ValueError("compressed-tensors pack-quantized weights with block scales are not supported")
    if any((g.get("input_activations") or {}) for g in groups):
        log.info("compressed-tensors: activation quantization is not applied; activations stay in the compute dtype")
    return a


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """int32 ``[r, w]`` -> int32 ``[r, n]``: the ``n`` unsigned values packed densely along dim 1."""
    words = packed.to(torch.int64) & 0xFFFFFFFF  # the words' bits, unsigned
    pos = torch.arange(n, dtype=torch.int64) * bits
    lo = words[:, pos // 32] >> (pos % 32)
    spill = (pos % 32) + bits > 32  # a value split over two words
    if bool(spill.any()):
        nxt = torch.clamp(pos // 32 + 1, max=packed.shape[1] - 1)
        lo = torch.where(spill, lo | (words[:, nxt] << (32 - pos % 32)), lo)
    return (lo & ((1 << bits) - 1)).to(torch.int32)


def _expand(scale: torch.Tensor, shape: tuple[int, int], args: dict) -> torch.Tensor:
    """A scale (or zero point) per element of a ``shape`` weight, whatever its strategy."""
    out, k = shape
    s = scale.float()
    if args["strategy"] == "tensor" or s.numel() == 1:
        return s.reshape(1, 1).expand(out, k)
    if args["strategy"] == "block":
        b0, b1 = args.get("block_structure") or (128, 128)
        return s.repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :k]
    if s.shape[-1] == 1:  # channel
        return s.reshape(out, 1).expand(out, k)
    return s.repeat_interleave(k // s.shape[1], 1)  # group


class CompressedInt4Tensor(PackedInt4Tensor):
    """A 4-bit ``pack-quantized`` weight as :class:`PackedInt4Tensor` (Int4Format at load)."""

    def __init__(self, parts: dict[str, torch.Tensor], args: dict, name: str) -> None:
        self.method, self.name = METHOD, name
        out, k = (int(x) for x in parts["weight_shape"].tolist())
        u = _unpack(parts["weight_packed"], 4, k)  # q + 8
        scale = parts["weight_scale"].float().reshape(out, -1)
        zp = parts.get("weight_zero_point")
        zp = (
            torch.zeros_like(scale)
            if zp is None
            else (_unpack(zp.t().contiguous(), 4, out).t().float() - 8).reshape(out, -1)
        )
        group = k // scale.shape[1]
        if group not in (32, 64, 128, 256):  # a channel (or odd) scale: the same one in smaller groups
            group = next((g for g in (128, 64, 32) if k % g == 0 and group % g == 0), None)
            if group is None:
                raise ValueError(f"{name}: int4 groups of {k // scale.shape[1]} columns do not fit the int4 layout")
            reps = k // group // scale.shape[1]
            scale, zp = scale.repeat_interleave(reps, 1), zp.repeat_interleave(reps, 1)
        self.group = group
        self.q = u.to(torch.uint8).contiguous()
        self.scale = scale.contiguous()
        self.zero = (-zp * scale).contiguous()
        self.in_perm = None
        g_idx = parts.get("weight_g_idx")
        if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group):
            # activation order: the input columns sorted by group, the layer gathering its input so
            perm = torch.argsort(g_idx.long(), stable=True)
            self.in_perm = perm
            self.q = self.q[:, perm].contiguous()


def _dequantized(parts: dict[str, torch.Tensor], args: dict, name: str) -> torch.Tensor:
    """The fp32 weight of an int-, float- or non-4-bit pack-quantized layer."""
    if "weight_packed" in parts:
        out, k = (int(x) for x in parts["weight_shape"].tolist())
        bits = int(args["num_bits"])
        q = _unpack(parts["weight_packed"], bits, k).float() - (1 << (bits - 1))
        zp = parts.get("weight_zero_point")
        if zp is not None:
            zp = _unpack(zp.t().contiguous(), bits, out).t().float() - (1 << (bits - 1))
    else:
        w = parts["weight"]
        q, zp = w.float(), parts.get("weight_zero_point")
        out, k = q.shape
    scale = _expand(parts["weight_scale"], (out, k), args)
    if zp is not None and not args.get("symmetric", True):
        q = q - _expand(zp, (out, k), args)
    return q * scale


def compressed_tensors_weights(
    weights: Iterable[tuple[str, torch.Tensor]], hf_config: dict
) -> Iterator[tuple[str, object]]:
    """Regroup each quantized layer's tensors into one ``X.weight``: a
    :class:`CompressedInt4Tensor` for 4-bit packed weights, else the dequantized fp32 weight;
    dense tensors pass through."""
    args = weight_args(hf_config)
    int4 = args["format"] == "pack-quantized" and int(args["num_bits"]) == 4
    need = (
        {"weight_packed", "weight_scale", "weight_shape"}
        if args["format"] == "pack-quantized"
        else {"weight", "weight_scale"}
    )
    if not args.get("symmetric", True) and args["strategy"] in ("group", "channel"):
        need.add("weight_zero_point")
    if args.get("actorder") == "group":
        need.add("weight_g_idx")
    pending: dict[str, dict[str, torch.Tensor]] = {}
    dequantized = 0
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf in _DROPPED:
            continue
        quantized_leaf = leaf in _LEAVES and (leaf != "weight" or tensor.dtype in (torch.int8, torch.float8_e4m3fn))
        if not quantized_leaf:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if need <= parts.keys():
            parts = pending.pop(prefix)
            if int4:
                yield f"{prefix}.weight", CompressedInt4Tensor(parts, args, prefix)
            else:
                dequantized += 1
                yield f"{prefix}.weight", _dequantized(parts, args, prefix)
    # a float weight_scale with no quantized weight beside it is not a layer of ours: an error
    if pending:
        missing = {p: sorted(need - v.keys()) for p, v in pending.items()}
        raise KeyError(f"incomplete compressed-tensors layers (missing tensors): {dict(list(missing.items())[:3])}")
    if dequantized:
        log.info(
            "compressed-tensors %s %s-bit weights of %d layers dequantized to the compute dtype "
            "(--quantization int8 serves them on the int8 kernel)",
            args["format"], args.get("num_bits"), dequantized,
        )  # fmt: skip
