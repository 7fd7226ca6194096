"""The one linear layer every model builds on: its parallel style and its weight format in one place.

- The *parallel style* says which slice of the checkpoint tensor this rank holds: ``replicated``
  (all of it), ``column`` (a slice of the output rows; fused projections such as QKV are several
  *parts*, each split on its own, by heads) or ``row`` (a slice of the input columns, outputs summed
  over the ranks with an all-reduce).
- The *weight format* says how the slice is stored and multiplied: dense in the compute dtype, or a
  quantized layout (:class:`WeightFormat` subclasses). A checkpoint tensor that arrives already
  quantized (a GGUF block tensor) names its own format through ``weight_format()``, so loading
  slices and packs in one pass and never expands it to a resident dense copy.

Experts of a mixture-of-experts block are a batched variant of the same idea (one slice per expert).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.core.model.hot_module import HotModule
from llmkit.core.model.parallel import SINGLE, TPGroup

# Rows per GEMM call in deterministic mode. MKL picks different kernels (and summation orders)
# for different row counts, so a row's result depends on its batch-mates; multiplying fixed,
# zero-padded tiles of rows makes every row's result independent of the batch.
DETERMINISTIC_TILE = 16

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")

PARALLEL_STYLES = ("replicated", "column", "row")


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias):
    # On CPU, oneDNN's fp32 GEMM beats F.linear's MKL path for decode-sized row counts (measured:
    # 1.15x for one row, 1.3x for 16), while MKL is a few percent faster for long prefills.
    if (
        _ONEDNN
        and x.shape[0] < 256
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
    ):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias=None, deterministic: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias``; in deterministic mode in fixed tiles of rows (see above)."""
    if not deterministic:
        return _gemm(x, weight, bias)
    return in_tiles(x, lambda t: _gemm(t, weight, bias))


def in_tiles(x: torch.Tensor, gemm) -> torch.Tensor:
    """``gemm`` over zero-padded tiles of :data:`DETERMINISTIC_TILE` rows: every call has the same
    shape, so a row's result does not depend on how many rows its batch has."""
    m = x.shape[0]
    pad = (-m) % DETERMINISTIC_TILE
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    return torch.cat([gemm(t) for t in x.split(DETERMINISTIC_TILE)])[:m]


class WeightFormat:
    """How a :class:`Linear` stores its weight and multiplies by it. This base is the dense format:
    ``layer.weight`` is an ``[out, in]`` parameter in the compute dtype."""

    name = "dense"

    @classmethod
    def for_quantization(cls, group_size: int | None) -> "WeightFormat":
        """The format ``--quantization`` builds from its name (``--quantization-group-size``:
        the groups of a grouped method; ignored by the others)."""
        return cls()

    def create(self, layer: "Linear", out_features: int, in_features: int) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def load(self, layer: "Linear", src: Any, dst_rows: slice, src_rows: slice, src_cols: slice) -> None:
        """Copy ``src[src_rows, src_cols]`` (a checkpoint tensor) into rows ``dst_rows``."""
        src = src.dequantize() if hasattr(src, "dequantize") else src
        layer.weight.data[dst_rows].copy_(src[src_rows, src_cols])

    def for_features(self, in_features: int) -> "WeightFormat":
        """This format fitted to a layer with ``in_features`` inputs (int4 narrows its group to
        one that divides them); the format itself when it has nothing to fit."""
        return self

    def finalize(self, layer: "Linear") -> None:
        """Pack or repack once every part is loaded (quantized formats)."""

    def take_staged(self, layer: "Linear") -> torch.Tensor:
        """The values loaded so far, before :meth:`finalize`, as a dense ``[out, in]`` tensor, the
        staging released (a fused layer moving its staged parts to another format)."""
        w, layer.weight = layer.weight, None
        return w

    def apply(self, layer: "Linear", x: torch.Tensor, deterministic: bool) -> torch.Tensor:
        """``x @ W.T`` without the bias."""
        return dense_linear(x, layer.weight, None, deterministic)

    def dense_weight(self, layer: "Linear") -> torch.Tensor:
        """The weight as a dense ``[out, in]`` tensor (reference checks, conversions)."""
        return layer.weight

    def embed(self, layer: "Linear", ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight (a quantized embedding table dequantizes only those)."""
        return F.embedding(ids, self.dense_weight(layer))


DENSE = WeightFormat()


class Linear(HotModule):
    """``y = x W^T + b``, sharded by ``parallel`` over ``tp`` and stored in ``fmt``.

    ``parts``: for a fused column-parallel projection, ``(rows, units)`` per logical part, e.g.
    ``[(q, n_heads), (kv, n_kv_heads), (kv, n_kv_heads)]``: each part's rows are split by whole
    units (heads) across the ranks, KV heads replicated when there are fewer than ranks.
    ``in_units``: for a row-parallel layer, the units its input columns are split by (heads for
    ``o_proj``). ``gather_output``: all-gather a column-parallel output (the LM head).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        parallel: str = "replicated",
        parts: Sequence[tuple[int, int]] | None = None,
        in_units: int | None = None,
        tp: TPGroup | None = None,
        fmt: WeightFormat | None = None,
    ) -> None:
        super().__init__()
        if parallel not in PARALLEL_STYLES:
            raise ValueError(f"parallel style '{parallel}' is not one of {PARALLEL_STYLES}")
        tp = tp or SINGLE
        self.parallel = parallel if tp.size > 1 else "replicated"
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        parts = list(parts or [(out_features, out_features)])
        if sum(p[0] for p in parts) != out_features:
            raise ValueError(f"parts {parts} do not add up to {out_features} output features")
        self.part_rows = [rows for rows, _ in parts]  # each part's rows in the checkpoint (unsharded)
        # per part: (source row range, destination row offset)
        self._row_map: list[tuple[int, int, int]] = []
        dst = 0
        for rows, units in parts:
            if self.parallel == "column":
                lo, hi = tp.units(units, "output units")
                per = rows // units
                lo, hi = lo * per, hi * per
            else:
                lo, hi = 0, rows
            self._row_map.append((lo, hi, dst))
            dst += hi - lo
        self.local_out = dst
        if self.parallel == "row":
            units = in_units or in_features
            lo, hi = tp.units(units, "input units")
            per = in_features // units
            self._cols = slice(lo * per, hi * per)
        else:
            self._cols = slice(0, in_features)
        self.local_in = self._cols.stop - self._cols.start
        self._parts_loaded: set[int] = set()  # the weight parts loaded from a quantized source
        self.format = fmt or DENSE
        # GPTQ act order's input permutation (int4_checkpoints registers it); declared so that
        # reading it never takes getattr's failed-lookup path (~1 us, on every call).
        self.register_buffer("in_perm", None, persistent=False)
        self.format.create(self, self.local_out, self.local_in)
        # A row-parallel bias is added once, after the all-reduce, so every rank holds all of it.
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.local_out), requires_grad=False)
        else:
            self.bias = None

    def load(self, tensor: Any, part: int = 0) -> None:
        """Load the checkpoint's full ``tensor`` (weight ``[rows, in]`` or bias ``[rows]``) of
        ``part``, keeping this rank's slice."""
        lo, hi, dst = self._row_map[part]
        rows = slice(dst, dst + hi - lo)
        if len(tensor.shape) == 1:
            b = tensor.dequantize() if hasattr(tensor, "dequantize") else tensor
            self.bias.data[rows].copy_(b[lo:hi])
            return
        quantized = hasattr(tensor, "weight_format")
        if quantized:
            fmt = tensor.weight_format(self)
            if fmt is not self.format and not self._parts_loaded:
                self.format = fmt
                fmt.create(self, self.local_out, self.local_in)
            elif fmt is not self.format:
                self._join_types(fmt)
                if self.format is not fmt:
                    tensor = tensor.dequantize()
        self.format.load(self, tensor, rows, slice(lo, hi), self._cols)
        if quantized:
            # An already quantized source (GGUF, GPTQ/AWQ) stages its values unpacked (int4: 1.25
            # bytes a weight; int8 from Q8_0/Q5_K/Q6_K: the fp32 weight): pack as soon as every
            # part is in, so only one layer's staging is resident at a time, not the whole model's
            # (an 8B Q4_0 GGUF staged ~8.7 GB until finalize_weights). finalize() is idempotent.
            self._parts_loaded.add(part)
            if len(self._parts_loaded) == len(self._row_map):
                self.format.finalize(self)

    def _join_types(self, fmt: WeightFormat) -> None:
        """The parts of a fused layer arrive in different quantized types (llama.cpp's Q4_K_M
        stores some layers' V at Q6_K beside Q4_K Q and K): int8, the finer, holds all of them.
        An int4 layer's staged parts move to int8; an int4 part joining an int8 layer is loaded
        from its dequantized values (the caller's ``dequantize()``)."""
        if self.format.name == "int8" or fmt.name != "int8":
            return
        staged = self.format.take_staged(self)
        self.format = fmt
        fmt.create(self, self.local_out, self.local_in)
        everything = slice(0, self.local_out)
        fmt.load(self, staged, everything, everything, slice(0, self.local_in))

    def finalize(self) -> None:
        self.format.finalize(self)

    def set_format(self, fmt: WeightFormat) -> None:
        """Convert the loaded weight to ``fmt`` (``--quantization`` of a dense checkpoint)."""
        dense = self.format.dense_weight(self).detach()
        self.format = fmt
        fmt.create(self, self.local_out, self.local_in)
        fmt.load(self, dense, slice(0, self.local_out), slice(0, self.local_out), slice(0, self.local_in))
        fmt.finalize(self)

    @property
    def bias_foldable(self) -> bool:
        """Whether a caller may take ``forward(add_bias=False)`` and add :attr:`bias` itself
        (inside a kernel of its own): a column-parallel layer with a bias."""
        return self.bias is not None and self.parallel != "row"

    def forward(self, x: torch.Tensor, deterministic: bool = False, add_bias: bool = True) -> torch.Tensor:
        # (LoRALinear repeats these steps for a row-parallel layer: its delta joins before the all-reduce)
        y = self.format.apply(self, x, deterministic)
        if self.parallel == "row":
            y = self.tp.all_reduce(y)
        return y if self.bias is None or not add_bias else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, parallel={self.parallel}, format={self.format.name}"


class VocabEmbedding(nn.Module):
    """Token embeddings split by vocabulary rows over the ranks: each rank looks up the ids it
    owns (zeros for the rest) and an all-reduce sums the rows. The rows are padded to a multiple of
    the TP size; the padding is never looked up.

    A checkpoint tensor that names its own weight format (a GGUF block tensor) is kept in that
    format in ``qtable`` (a :class:`Linear` over this rank's rows) instead of the dense ``weight``:
    a lookup dequantizes only the rows it needs, and a tied LM head multiplies by it directly."""

    def __init__(self, vocab: int, hidden: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp or SINGLE
        self.vocab = vocab
        self.hidden = hidden
        per = -(-vocab // self.tp.size)
        self.lo = self.tp.rank * per
        self.hi = min(vocab, self.lo + per)
        # Only the padding rows are zeroed: a table loaded quantized never touches the rest.
        self.weight = nn.Parameter(torch.empty(per, hidden), requires_grad=False)
        self.weight.data[self.hi - self.lo :].zero_()
        # A plain list, not a child module: loading, --quantization and finalize_weights walk the
        # Linear modules of the model, and this one is loaded and packed here.
        self._qtable: list[Linear] = []

    @property
    def qtable(self) -> Linear | None:
        return self._qtable[0] if self._qtable else None

    def load(self, tensor: torch.Tensor) -> None:
        if hasattr(tensor, "weight_format"):
            self.weight = None  # no dense table stays resident
            table = Linear(self.hidden, self.hi - self.lo)
            table.load(tensor.row_slice(self.lo, self.hi))
            table.finalize()
            self._qtable = [table]
            return
        t = tensor.dequantize() if hasattr(tensor, "dequantize") else tensor
        self.weight.data[: self.hi - self.lo].copy_(t[self.lo : self.hi])

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qtable is not None:
            return self.qtable.format.embed(self.qtable, ids)
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(ids)
        local = ids - self.lo
        own = (local >= 0) & (local < self.hi - self.lo)
        out = self._lookup(torch.where(own, local, torch.zeros_like(local)))
        out = out * own.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


class LMHead(nn.Module):
    """The vocabulary projection, split by vocabulary rows like :class:`VocabEmbedding` (whose
    weight it shares when the embeddings are tied) with the logits all-gathered in rank order."""

    def __init__(self, vocab: int, hidden: int, tp: TPGroup | None = None, tied: VocabEmbedding | None = None):
        super().__init__()
        self.tp = tp or SINGLE
        self.vocab = vocab
        # A plain list, not a child module: the embedding's weight is registered (and loaded) once.
        self._tied = [tied] if tied is not None else []
        if tied is None:
            self.proj = VocabEmbedding(vocab, hidden, tp)  # same row split; used as a matrix
        self.format: WeightFormat = DENSE
        self.fmt_layer: Linear | None = None  # a quantized copy of the (local) weight, when quantized

    @property
    def tied(self) -> VocabEmbedding | None:
        return self._tied[0] if self._tied else None

    def _table(self) -> VocabEmbedding:
        return self.tied if self.tied is not None else self.proj

    def load(self, tensor: torch.Tensor) -> None:
        self.proj.load(tensor)

    def set_format(self, fmt: WeightFormat) -> None:
        table = self._table()
        if table.qtable is not None:  # already quantized at load (GGUF): requantize its dequantized rows
            w = table.qtable.format.dense_weight(table.qtable)
        else:
            w = table.weight
        # built in ``fmt`` on the table's device (CUDA's int4 runs there), loaded straight from the
        # table: no second dense copy
        with torch.device(w.device):
            layer = Linear(w.shape[1], w.shape[0], fmt=fmt)
        rows, cols = slice(0, w.shape[0]), slice(0, w.shape[1])
        fmt.load(layer, w.detach(), rows, rows, cols)
        layer.finalize()
        self.fmt_layer = layer

    def forward(self, hidden: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        table = self._table()
        layer = self.fmt_layer if self.fmt_layer is not None else table.qtable
        if layer is not None:
            logits = layer(hidden.float(), deterministic)
            per = -(-self.vocab // self.tp.size)
            if logits.shape[-1] < per:  # the padding rows of the last rank's slice
                logits = F.pad(logits, (0, per - logits.shape[-1]))
        else:
            w = table.weight
            logits = dense_linear(hidden.to(w.dtype), w, None, deterministic)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits, dim=-1)
        return logits[:, : self.vocab].float()
