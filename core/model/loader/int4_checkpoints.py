"""Hugging Face int4 checkpoints (GPTQ, AWQ) loaded onto :class:`Int4Format` without requantizing.

Both store, per linear layer, 4-bit values packed eight to an int32, one fp16 scale and a 4-bit zero
per group of input columns (``group_size``, usually 128):

- GPTQ (AutoGPTQ / GPTQModel ``checkpoint_format: gptq``): ``qweight`` int32 ``[in/8, out]``
  (packed along the input dim, value ``j`` in bits ``4j..4j+3``), ``qzeros`` int32
  ``[groups, out/8]`` (packed along the output dim, stored minus one), ``scales`` fp16
  ``[groups, out]``, ``g_idx`` int32 ``[in]`` (each input column's group; a permutation of
  ``k // group`` under ``desc_act``). ``w[n, k] = s[g, n] * (q[k, n] - (z[g, n] + 1))``, ``g = g_idx[k]``.
- AWQ (AutoAWQ ``version: gemm``): ``qweight`` int32 ``[in, out/8]`` and ``qzeros`` int32
  ``[groups, out/8]``, both packed along the output dim in the interleaved order
  ``[0, 2, 4, 6, 1, 3, 5, 7]``; ``scales`` fp16 ``[groups, out]``; ``w[n, k] = s * (q - z)``.

In int4-group terms (``w = (q - 8) * scale + zero``): ``scale = s`` and ``zero = s * (7 - z)`` (GPTQ)
or ``s * (8 - z)`` (AWQ). A GPTQ act-order layer (``desc_act``) has its input columns sorted by
group at load, and the layer gathers its input in that order (``in_perm``). Both load onto
:class:`Int4Format` on CPU (its C or torch kernel) and on CUDA (its Triton kernel).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

METHODS = ("gptq", "awq")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[r, c]`` -> uint8 ``[8r, c]``: value ``j`` of ``packed[i]`` is row ``8i + j``."""
    r, c = packed.shape
    vals = (packed.to(torch.int32)[:, None, :] >> _SHIFTS[None, :, None]) & 15
    return vals.reshape(8 * r, c).to(torch.uint8)


def _unpack_cols(packed: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """int32 ``[r, c]`` -> uint8 ``[r, 8c]``: value ``j`` of ``packed[:, i]`` is column ``8i + order[j]``."""
    r, c = packed.shape
    vals = (packed.to(torch.int32)[:, :, None] >> _SHIFTS[None, None, :]) & 15  # [r, c, 8] by nibble
    inv = torch.argsort(torch.tensor(order))
    return vals[:, :, inv].reshape(r, 8 * c).to(torch.uint8)


class PackedInt4Tensor:
    """One GPTQ or AWQ linear weight ``[out, in]``, unpacked to 4-bit values (uint8) at load."""

    def __init__(self, method: str, group: int, parts: dict[str, torch.Tensor], name: str) -> None:
        self.method, self.group, self.name = method, group, name
        scales = parts["scales"].float()  # [groups, out]
        if method == "gptq":
            self.q = _unpack_rows(parts["qweight"]).t().contiguous()  # [out, in]
            zeros = _unpack_cols(parts["qzeros"]).float()[:, : scales.shape[1]]
            zero = scales * (7 - zeros)
            k = self.q.shape[1]
            g_idx = parts.get("g_idx")
            g_idx = torch.arange(k) // group if g_idx is None else g_idx.long()
            if torch.equal(g_idx, torch.arange(k) // group):
                self.in_perm = None
            else:  # act order: sort the input columns by group
                perm = torch.argsort(g_idx, stable=True)
                counts = torch.bincount(g_idx, minlength=scales.shape[0])
                if not bool((counts == group).all()):
                    raise ValueError(f"{name}: GPTQ g_idx does not put {group} input columns in every group")
                self.in_perm = perm
                self.q = self.q[:, perm].contiguous()
        else:
            self.q = _unpack_cols(parts["qweight"], _AWQ_ORDER).t().contiguous()  # [out, in]
            zeros = _unpack_cols(parts["qzeros"], _AWQ_ORDER).float()[:, : scales.shape[1]]
            zero = scales * (8 - zeros)
            self.in_perm = None
        self.scale = scales.t().contiguous()  # [out, groups]
        self.zero = zero.t().contiguous()

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def weight_format(self, layer):
        from llmkit.core.model.quant.int4_format import Int4Format, device_of

        device = device_of(layer)
        if device.type not in ("cpu", "cuda"):
            return layer.format  # no int4 kernel there: served dequantized (dequantize())
        if self.in_perm is not None:
            if layer.parallel == "row":
                raise ValueError(f"{self.name}: a GPTQ act-order (desc_act) weight cannot be split by input columns")
            perm = self.in_perm.to(device)
            if getattr(layer, "in_perm", None) is not None and not torch.equal(layer.in_perm, perm):
                raise ValueError(f"{self.name}: fused parts have different GPTQ act orders")
            layer.register_buffer("in_perm", perm, persistent=False)
        fmt = layer.format
        if getattr(fmt, "name", "") == "int4" and fmt.group == self.group:
            return fmt
        return Int4Format(self.group)

    def int4_groups(self, rows: slice, cols: slice):
        g = slice(cols.start // self.group, cols.stop // self.group)
        return self.q[rows, cols], self.scale[rows, g], self.zero[rows, g]

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight ``[out, in]`` in the checkpoint's column order."""
        out, k = self.q.shape
        w = (self.q.float().view(out, -1, self.group) - 8) * self.scale[..., None] + self.zero[..., None]
        w = w.view(out, k)
        if self.in_perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.in_perm, w)
        return w


def quant_method(hf_config: dict) -> str | None:
    """The checkpoint's int4 method (``gptq``/``awq``), None for a dense one; fails for others."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ValueError(
            f"checkpoint quantization '{method}' is not supported; supported: {', '.join(METHODS)}, compressed-tensors"
        )
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise ValueError(f"{method} with {bits} bits is not supported; supported: 4 bits")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"AWQ version '{qc.get('version')}' is not supported; supported: gemm")
    if method == "gptq" and not qc.get("sym", True) and qc.get("checkpoint_format", "gptq") != "gptq":
        raise ValueError(f"GPTQ checkpoint format '{qc.get('checkpoint_format')}' is not supported; supported: gptq")
    return method


def int4_checkpoint_weights(
    weights: Iterable[tuple[str, torch.Tensor]], hf_config: dict
) -> Iterator[tuple[str, object]]:
    """Regroup a GPTQ/AWQ checkpoint's ``X.qweight``/``X.qzeros``/``X.scales``/``X.g_idx`` into one
    ``X.weight`` (:class:`PackedInt4Tensor`); other tensors pass through."""
    method = quant_method(hf_config)
    qc = hf_config["quantization_config"]
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    need = {"qweight", "qzeros", "scales"} | ({"g_idx"} if method == "gptq" else set())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in ("qweight", "qzeros", "scales", "g_idx"):
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if need <= parts.keys():
            yield f"{prefix}.weight", PackedInt4Tensor(method, group, pending.pop(prefix), prefix)
    if pending:
        missing = {p: sorted(need - v.keys()) for p, v in pending.items()}
        raise KeyError(f"incomplete {method} layers (missing tensors): {dict(list(missing.items())[:3])}")
