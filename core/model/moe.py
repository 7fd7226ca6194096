"""Mixture-of-experts building blocks: routing and the batched experts every MoE model shares.

:class:`FusedExperts` is the batched variant of :class:`~llmkit.core.model.linear.Linear`: the E
experts' gate/up projections are one ``[E, 2I, H]`` weight and their down projections one
``[E, H, I]`` weight. Under tensor parallelism each rank holds a slice of every expert's intermediate
channels (gate/up column-parallel, down row-parallel) and the partial outputs are summed with one
all-reduce, as a row-parallel layer does.

Execution. The torch path (CPU): the ``T x k`` (token, expert) assignments are sorted by expert,
and each *active* expert multiplies its contiguous block of rows in one GEMM. The loop runs over
experts, never over tokens; the results are scattered back to their (token, slot) places and
combined with the routing weights in slot order, so a token's sum never depends on its batch-mates.
On CUDA (with ``triton`` installed) the same computation runs as one fused grouped GEMM per
projection (:mod:`llmkit.core.model.fused_moe_triton`), over the rows
:func:`~llmkit.core.model.moe_align.moe_align` sorts.

Weight format. Like a :class:`~llmkit.core.model.linear.Linear`, the experts carry one: ``dense``
(the batched parameters above) or a quantized one (int4, int8). Quantized, each expert's two
projections are a :class:`~llmkit.core.model.linear.Linear` in that format (its gate/up rows one
layer, its down rows another), so the per-layer formats' loading, packing and kernels serve the
experts as they are: no batched ``w13``/``w2`` exists, only the E packed pairs. A GGUF's expert
tensors name their format (Q4_0/Q4_1/Q4_K: int4 groups of 32, Q8_0/Q5_K/Q6_K: int8 per row, as a
dense layer's); ``--quantization int4|int8`` sets it before loading (:meth:`FusedExperts.set_format`),
so each expert is quantized as its tensors arrive. int8 experts keep no dense copy (a dense layer
keeps one for prefill; the experts' would be the fp32 model over again). Quantized experts are a
CPU path: a module built on another device refuses them at load.
"""

from __future__ import annotations

import importlib.util
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.core.model.linear import DENSE, Linear, WeightFormat, dense_linear
from llmkit.core.model.parallel import SINGLE, TPGroup

GATE, UP, DOWN = 0, 1, 2


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the softmax over all experts (Qwen-MoE, Mixtral); weights renormalised to sum to 1
    when ``renormalize`` (``norm_topk_prob``). Returns fp32 weights ``[T, k]`` and ids ``[T, k]``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_topk(
    logits: torch.Tensor,
    k: int,
    *,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    correction_bias: torch.Tensor | None = None,
    scale: float = 1.0,
    scoring: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing. V3 ("noaux_tc", ``scoring="sigmoid"``): experts are chosen by score plus
    ``correction_bias`` within the ``topk_group`` groups (of ``n_group``) whose two best biased
    scores sum highest. V2 (``scoring="softmax"``, "greedy" / "group_limited_greedy"): softmax
    scores, groups ranked by their best score. The weights are the unbiased scores, renormalised
    when ``renormalize``, times ``scale`` (``routed_scaling_factor``). Returns fp32 ``[T, k]``
    weights and ids."""
    scores = logits.float().sigmoid() if scoring == "sigmoid" else logits.float().softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    t, e = choice.shape
    per = e // n_group
    if n_group > 1 and topk_group < n_group:
        if scoring == "sigmoid":
            group_scores = choice.view(t, n_group, per).topk(min(2, per), dim=-1).values.sum(dim=-1)
        else:
            group_scores = choice.view(t, n_group, per).max(dim=-1).values
        groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
    ids = choice.topk(k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


class FusedExperts(nn.Module):
    """``num_experts`` gated MLPs stored as batched weights ``w13 [E, 2I_local, H]`` (gate rows then
    up rows) and ``w2 [E, H, I_local]``, with optional biases.

    ``activation`` maps the ``[N, 2I_local]`` gate/up output to ``[N, I_local]`` (SiLU-and-mul by
    default; gpt-oss passes its clamped SwiGLU, whose gate/up rows it de-interleaves at load).
    ``gated=False``: experts with an up projection and no gate (Nemotron-H's ReLU² experts):
    ``w13`` holds the up rows alone, ``[E, I_local, H]``, and ``activation`` maps them in place.
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        *,
        bias: bool = False,
        tp: TPGroup | None = None,
        activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
        gated: bool = True,
    ) -> None:
        super().__init__()
        self.tp = tp or SINGLE
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        lo, hi = self.tp.units(intermediate, "the experts' intermediate size")
        self._cols = slice(lo, hi)
        self.local_inter = hi - lo
        self.activation, self.gated = activation, gated
        rows = (2 if gated else 1) * self.local_inter
        self.w13 = nn.Parameter(torch.empty(num_experts, rows, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.local_inter), requires_grad=False)
        if bias:
            self.b13 = nn.Parameter(torch.zeros(num_experts, rows), requires_grad=False)
            self.b2 = nn.Parameter(torch.zeros(num_experts, hidden), requires_grad=False)
        else:
            self.b13 = self.b2 = None
        self._loaded: set[tuple[int, int, str]] = set()
        self._device = self.w13.device
        self.format: WeightFormat = DENSE
        # Quantized: per expert [gate/up layer, down layer], each made when its first tensor
        # arrives. A plain list, not child modules: the model's walks over its Linear layers
        # (loading checks, --quantization, finalize_weights) must not take them for its own, as
        # with VocabEmbedding's qtable.
        self._layers: list[list[Linear | None]] = []
        #: run the fused Triton kernel: None = on CUDA when triton is installed (tests set True to
        #: run it on CPU under Triton's interpreter)
        self.use_triton: bool | None = None

    # --- loading -----------------------------------------------------------------------------

    @property
    def quantized(self) -> bool:
        return self.format is not DENSE

    def load(self, tensor: torch.Tensor, expert: int, proj: int) -> None:
        """Load one expert's full checkpoint ``gate``/``up`` (``[I, H]``, or bias ``[I]``) or
        ``down`` (``[H, I]``, or bias ``[H]``) tensor, keeping this rank's channels. A weight that
        arrives quantized (a GGUF block tensor) turns the experts quantized."""
        if proj == GATE and not self.gated:
            raise KeyError("these experts have no gate projection")
        if len(tensor.shape) == 2 and hasattr(tensor, "weight_format") and not self.quantized:
            self.set_format(tensor.weight_format(self))
        if len(tensor.shape) == 2 and self.quantized:
            layer = self._layer(expert, DOWN if proj == DOWN else GATE, tensor)
            layer.load(tensor, 1 if proj == UP and self.gated else 0)  # (it slices its rank's rows / columns)
            self._loaded.add((expert, proj, "weight"))
            self._finish(expert)
            return
        t = tensor.dequantize() if hasattr(tensor, "dequantize") else tensor
        li = self.local_inter
        kind = "bias" if t.dim() == 1 else "weight"
        if proj in (GATE, UP):
            dst = slice(li, 2 * li) if proj == UP and self.gated else slice(0, li)
            if kind == "bias":
                self.b13.data[expert, dst].copy_(t[self._cols])
            else:
                self.w13.data[expert, dst].copy_(t[self._cols])
        elif kind == "bias":
            self.b2.data[expert].copy_(t)  # added once, after the all-reduce
        else:
            self.w2.data[expert].copy_(t[:, self._cols])
        self._loaded.add((expert, proj, kind))

    def load_stacked(self, tensor: torch.Tensor, proj: int) -> None:
        """Load all experts at once from a stacked ``[E, out, in]`` (or bias ``[E, out]``) tensor."""
        from llmkit.core.model.loader.source import materialize

        tensor = materialize(tensor)
        for e in range(self.num_experts):
            self.load(tensor[e], e, proj)

    def set_format(self, fmt: WeightFormat, filled: bool = False) -> None:
        """Store the experts in ``fmt`` (``--quantization``, or the format of a GGUF's expert
        tensors). Before loading, each expert is quantized as its tensors arrive; weights already
        loaded dense are converted one expert at a time, then the batched ``w13``/``w2`` go.
        ``filled``: the dense weights hold every expert although :meth:`load` did not put them
        there (dummy weights): convert them all. A no-op for ``dense`` or experts already quantized
        (a GGUF's own types stay as they are)."""
        if fmt.name == "dense" or self.quantized:
            return
        if filled:
            self._loaded |= {(e, p, "weight") for e in range(self.num_experts) for p in (*self._in_projs(), DOWN)}
        if self._device.type != "cpu":
            # (the fused Triton MoE kernel multiplies the batched dense weights; quantized experts
            # have no GPU path, though dense layers' int4 runs on CUDA through int4_triton)
            raise ValueError(f"quantized MoE experts are a CPU path; these are on {self._device}")
        if fmt.name == "int8" and getattr(fmt, "keep_dense", False):
            from llmkit.core.model.quant.int8 import Int8Format

            fmt = Int8Format(keep_dense=False)  # the experts' dense copy would be the fp32 model again
        self.format = fmt
        self._layers = [[None, None] for _ in range(self.num_experts)]
        w13, w2, li = self.w13, self.w2, self.local_inter
        self.w13 = self.w2 = None
        for e in range(self.num_experts):
            for proj in (GATE, UP, DOWN):
                if (e, proj, "weight") not in self._loaded:
                    continue
                layer = self._layer(e, proj, None)
                if proj == DOWN:
                    local, rows = w2.data[e], slice(0, self.hidden)
                else:
                    rows = slice(li, 2 * li) if proj == UP and self.gated else slice(0, li)
                    local = w13.data[e, rows]
                layer.format.load(layer, local, rows, slice(0, local.shape[0]), slice(0, layer.local_in))
            self._finish(e)

    def _layer(self, expert: int, proj: int, tensor) -> Linear:
        """Expert ``expert``'s gate/up (``proj`` GATE or UP) or down layer, made on first use in
        the format ``tensor`` names (a quantized checkpoint tensor) or the experts' own. The layers
        carry this rank's slicing: gate/up column-parallel by channel, down row-parallel (its
        partial sums are reduced once, by :meth:`forward`, never by the layer)."""
        i = 1 if proj == DOWN else 0
        layer = self._layers[expert][i]
        if layer is None:
            fmt = tensor.weight_format(self) if hasattr(tensor, "weight_format") else self.format
            inter, h = self.intermediate, self.hidden
            if i == 0:
                fmt = fmt.for_features(h)
                parts = [(inter, inter)] * (2 if self.gated else 1)
                layer = Linear(h, len(parts) * inter, parallel="column", parts=parts, tp=self.tp, fmt=fmt)
            else:
                fmt = fmt.for_features(self.local_inter)
                layer = Linear(inter, h, parallel="row", in_units=inter, tp=self.tp, fmt=fmt)
            self._layers[expert][i] = layer
        return layer

    def _finish(self, expert: int) -> None:
        """Pack an expert's layers once their rows are all in: only one expert's staging (the
        unpacked values) is resident at a time, never the whole fp32 block."""
        g13, g2 = self._layers[expert]
        if g13 is not None and {(expert, p, "weight") for p in self._in_projs()} <= self._loaded:
            g13.finalize()
        if g2 is not None and (expert, DOWN, "weight") in self._loaded:
            g2.finalize()

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``expert``'s ``w13 [2I_local, H]`` and ``w2 [H, I_local]``, dequantized where
        quantized (reference checks)."""
        if not self.quantized:
            return self.w13[expert], self.w2[expert]
        g13, g2 = self._layers[expert]
        return g13.format.dense_weight(g13), g2.format.dense_weight(g2)

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor holding the experts' weights and biases, by name: ``w13``/``w2`` when
        dense, else each expert layer's buffers (``3.w13.q4_packed``...). The quantized buffers
        are not in ``state_dict()`` (nor are a quantized Linear's: they are not persistent)."""
        out = {n: t for n, t in (("b13", self.b13), ("b2", self.b2)) if t is not None}
        if not self.quantized:
            return {"w13": self.w13, "w2": self.w2, **out}
        for e, pair in enumerate(self._layers):
            for name, layer in zip(("w13", "w2"), pair):
                if layer is not None:
                    out.update({f"{e}.{name}.{b}": t for b, t in layer.named_buffers() if t is not None})
                    out.update({f"{e}.{name}.{p}": t for p, t in layer.named_parameters()})
        return out

    def missing(self) -> list[str]:
        """Names (``expert.proj.kind``) of the tensors not loaded yet."""
        projs = (*self._in_projs(), DOWN)
        want = {(e, p, "weight") for e in range(self.num_experts) for p in projs}
        if self.b13 is not None:
            want |= {(e, p, "bias") for e in range(self.num_experts) for p in projs}
        names = ("gate_proj", "up_proj", "down_proj")
        return sorted(f"{e}.{names[p]}.{k}" for e, p, k in want - self._loaded)

    def _in_projs(self) -> tuple[int, ...]:
        return (GATE, UP) if self.gated else (UP,)

    # --- execution ---------------------------------------------------------------------------

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, deterministic: bool = False
    ) -> torch.Tensor:
        """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` for every token ``t``;
        ``x [T, H]``, ``topk_* [T, k]``."""
        use_triton = self.use_triton
        if use_triton is None:
            use_triton = x.is_cuda and _HAS_TRITON
        quantized = self.quantized
        if use_triton and x.shape[0] > 0 and not quantized:  # (quantized: CPU only, see set_format)
            from llmkit.core.model.fused_moe_triton import fused_experts

            b2 = self.b2 if self.tp.rank == 0 else None  # the down bias is added on one rank only
            y = fused_experts(
                x, self.w13, self.b13, self.w2, b2, topk_weights, topk_ids, self.activation, deterministic
            )
            return self.tp.all_reduce(y)
        t, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x.index_select(0, order // k)
        out = torch.empty(t * k, self.hidden, dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            block = rows[start : start + n]
            if quantized:
                # the layers' kernels: a row's result does not depend on the rows beside it, so the
                # grouping by expert leaves a request's output independent of its batch
                g13, g2 = self._layers[e]
                h = g13.format.apply(g13, block, deterministic)
                if self.b13 is not None:
                    h = h + self.b13[e]
                y = g2.format.apply(g2, self.activation(h), deterministic)
            else:
                h = dense_linear(block, self.w13[e], None if self.b13 is None else self.b13[e], deterministic)
                y = dense_linear(self.activation(h), self.w2[e], None, deterministic)
            out[order[start : start + n]] = y
            start += n
        if self.b2 is not None:
            # the down bias is part of each expert's output, weighted like it; added on one rank only
            bias = self.b2[flat] if self.tp.rank == 0 else 0
            out = out + bias
        y = (out.view(t, k, self.hidden) * topk_weights.to(out.dtype).unsqueeze(-1)).sum(dim=1)
        return self.tp.all_reduce(y)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}, "
            f"format={self.format.name}"
        )


_HAS_TRITON = importlib.util.find_spec("triton") is not None
