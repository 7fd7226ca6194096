"""A Llama-style decoder shared by the Llama, Qwen2 and Qwen3 plugins.

The variants differ only in QKV bias (Qwen2) and per-head Q/K RMSNorm (Qwen3). Q/K/V and
gate/up projections are fused into single weights so a step runs two GEMMs per block instead of five.
Under tensor parallelism QKV and gate/up are column-parallel (split by heads and channels), O and
down row-parallel, and the embedding and LM head split by vocabulary rows.
"""

from __future__ import annotations

from functools import partial
from typing import Iterable

import torch
from torch import nn

from llmkit.core.model import layers as model_layers
from llmkit.core.model.causal_lm import CausalLM, ForwardContext
from llmkit.core.model.cpu import cpu_decoder
from llmkit.core.model.cpu.cpu_decoder import NativeStack
from llmkit.core.model.cpu.cpu_lora import NativeLoRA
from llmkit.core.model.decoder.weight_placement import FUSED_PROJECTIONS, place_tensor
from llmkit.core.model.gemv_choice import gemv_faster
from llmkit.core.model.hot_module import HotModule
from llmkit.core.model.layers import RMSNorm, RotaryEmbedding, silu_mul
from llmkit.core.model.linear import Linear, LMHead, VocabEmbedding
from llmkit.core.model.parallel import TPGroup


class Attention(HotModule):
    def __init__(self, config: dict, layer_id: int, head_dim: int, qkv_bias: bool, qk_norm: bool, tp: TPGroup):
        super().__init__()
        self.layer_id = layer_id
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        hidden = config["hidden_size"]
        q, kv = heads * head_dim, kv_heads * head_dim
        self.qkv_proj = Linear(
            hidden,
            q + 2 * kv,
            bias=qkv_bias,
            parallel="column",
            parts=[(q, heads), (kv, kv_heads), (kv, kv_heads)],
            tp=tp,
        )
        self.o_proj = Linear(q, hidden, parallel="row", in_units=heads, tp=tp)
        # this rank's heads
        self.num_heads = heads * self.o_proj.local_in // q
        self.num_kv_heads = (self.qkv_proj.local_out - self.num_heads * head_dim) // (2 * head_dim)
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        eps = config.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext):
        det = ctx.deterministic
        proj = self.qkv_proj
        # A backend that folds the bias into its forward_qkv kernel saves the add's kernel.
        fold = self.q_norm is None and proj.bias_foldable and getattr(ctx.attn, "folds_qkv_bias", False)
        qkv = proj(x, det, add_bias=False) if fold else proj(x, det)
        return self.o_proj(self.attend(qkv, rope, ctx, proj.bias if fold else None), det)

    def attend(self, qkv, rope, ctx: ForwardContext, bias=None) -> torch.Tensor:
        """The heads' output ``[T, q_size]`` from the projection ``qkv``; ``bias``: the projection's
        bias where it is not added yet."""
        if self.q_norm is None:  # one backend call rotates, writes K/V and attends, where it can
            folds = bias is not None and getattr(ctx.attn, "folds_qkv_bias", False)
            o = ctx.attn.forward_qkv(qkv, rope, self.layer_id, ctx.metadata, **({"bias": bias} if folds else {}))
            if o is not None:
                return o.reshape(-1, self.q_size)
        if bias is not None:
            qkv = qkv + bias
        heads = self.num_heads + self.num_kv_heads
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # Q and K are adjacent in the fused projection: rotate them in one pass.
            qk = RotaryEmbedding.rotate(qkv[:, : self.q_size + self.kv_size].view(-1, heads, self.head_dim), rope)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = self.q_norm(qkv[:, : self.q_size].reshape(-1, self.num_heads, self.head_dim))
            k = self.k_norm(
                qkv[:, self.q_size : self.q_size + self.kv_size].reshape(-1, self.num_kv_heads, self.head_dim)
            )
            q, k = RotaryEmbedding.rotate(q, rope), RotaryEmbedding.rotate(k, rope)
        o = ctx.attn.forward(q, k, v, self.layer_id, ctx.metadata)
        return o.reshape(-1, self.q_size)


class MLP(HotModule):
    def __init__(self, hidden: int, inter: int, tp: TPGroup):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * inter, parallel="column", parts=[(inter, inter)] * 2, tp=tp)
        self.down_proj = Linear(inter, hidden, parallel="row", tp=tp)
        self.inter = self.down_proj.local_in

    def forward(self, x, det: bool):
        return self.down_proj(silu_mul(self.gate_up_proj(x, det), self.inter), det)


class PreNormBlock(HotModule):
    """A pre-norm transformer block; subclasses build ``input_layernorm``, ``self_attn``,
    ``post_attention_layernorm`` and ``mlp``. The residual sums are fused into the norms."""

    def forward(self, x, residual, rope, ctx):
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, ctx)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, ctx.deterministic), residual


class DecoderLayer(PreNormBlock):
    def __init__(self, config, layer_id, head_dim, qkv_bias, qk_norm, tp, mlp=None, attn: nn.Module | None = None):
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config["hidden_size"], eps)
        # ``attn``: the model's own attention (a VariantAttention) where it builds one
        self.self_attn = attn if attn is not None else Attention(config, layer_id, head_dim, qkv_bias, qk_norm, tp)
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps)
        # ``mlp(h, deterministic)``: the dense MLP unless the model builds another (MoE blocks)
        self.mlp = mlp if mlp is not None else MLP(config["hidden_size"], config["intermediate_size"], tp)

    _gemv_weights: "tuple | None | bool" = False  # False: not looked at yet (see gemv_weights)

    def forward(self, x, residual, rope, ctx):
        # (not in deterministic mode: rows past the GEMVs' few run on cuBLAS, whose sums differ)
        gemv = None if ctx.deterministic else model_layers.decode_gemv(x)  # (looked up here: tests patch it)
        if gemv is not None and (weights := self.gemv_weights()) is not None:
            on_gemvs = partial(self._forward_gemv, gemv, weights, x, residual, rope, ctx)
            if not model_layers.GEMV_MEASURED:
                return on_gemvs()
            # one key for every block of the same shapes (a dense model's layers share one choice)
            key = (x.shape[0], x.dtype, type(ctx.attn).__name__, *(tuple(w.shape) for w in weights))
            if gemv_faster(key, on_gemvs, partial(super().forward, x, residual, rope, ctx)):
                return on_gemvs()
        return super().forward(x, residual, rope, ctx)

    def gemv_weights(self) -> tuple | None:
        """The four projections' weights where the fused decode GEMVs can run them: dense, on one
        rank, no bias but QKV's, no adapter wrapped around them, the dense MLP; else None."""
        if self._gemv_weights is False:
            attn, mlp = self.self_attn, self.mlp
            linears = (attn.qkv_proj, attn.o_proj, getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
            # (a subclass of the block or of its attention computes something else between them)
            ok = (
                type(self) is DecoderLayer
                and type(attn) is Attention
                and type(mlp) is MLP
                and all(type(lin) is Linear and lin.format.name == "dense" and lin.tp.size == 1 for lin in linears)
            )
            ok = ok and all(lin.bias is None for lin in linears[1:])
            self._gemv_weights = tuple(lin.weight for lin in linears) if ok else None
        return self._gemv_weights

    def _forward_gemv(self, gemv, weights, x, residual, rope, ctx):
        """The block as five launches: norm + QKV + rotate-and-store, attention, O, norm + gate/up,
        SiLU-and-mul + down (triton_gemv.py); six where the backend does not let the QKV product
        write the K/V itself (its rotate-and-store then runs on its own)."""
        w_qkv, w_o, w_gate_up, w_down = weights
        attn, n1, n2 = self.self_attn, self.input_layernorm, self.post_attention_layernorm
        norm1 = {"norm": (n1.weight, n1.eps)}
        if residual is not None:
            norm1["residual"] = residual
        target, md, bias = self._kv_write_target(gemv, w_qkv, ctx), ctx.metadata, attn.qkv_proj.bias
        store = None if target is None else gemv.RopeStore(*rope, attn.num_heads, *target, md.out_slots, bias)
        out = gemv.gemv(x, w_qkv, rope=store, **norm1)  # with the store: the rotated q, K/V written
        qkv, residual = (out, x) if residual is None else out  # the first block: x is the residual
        if store is not None:
            h = ctx.attn.forward_written(qkv, attn.layer_id, md).reshape(-1, attn.q_size)
        else:
            h = attn.attend(qkv, rope, ctx, bias)
        gate_up, residual = gemv.gemv(gemv.gemv(h, w_o), w_gate_up, norm=(n2.weight, n2.eps), residual=residual)
        return gemv.gemv(gate_up, w_down, silu_mul=True), residual

    def _kv_write_target(self, gemv, w_qkv, ctx):
        """The pool buffers the QKV product may write the K/V into (no per-head norms between the
        product and the rotation, and the backend offers them), else None."""
        attn = self.self_attn
        if attn.q_norm is not None or not gemv.rope_fits(attn.head_dim, w_qkv.shape[0]):
            return None
        target = ctx.attn.kv_write_target(attn.layer_id, ctx.metadata)
        if target is None or target[0].shape[-1] != attn.head_dim or target[0].shape[1] != attn.num_kv_heads:
            return None
        return target


class StackedLM(CausalLM):
    """Embeddings, ``self.layers`` of :class:`PreNormBlock`, a final norm and the LM head: the
    skeleton every built-in architecture shares. A subclass builds ``embed_tokens`` and ``layers``,
    then calls :meth:`finish_stack`."""

    def finish_stack(self, eps: float, rotary_dim: int) -> None:
        config, hidden, vocab = self.config, self.config["hidden_size"], self.config["vocab_size"]
        self.norm = RMSNorm(hidden, eps)
        self.tie = bool(config.get("tie_word_embeddings", False))
        self.lm_head = LMHead(vocab, hidden, self.tp, tied=self.embed_tokens if self.tie else None)
        self.rotary = self.rotary_embedding(rotary_dim)

    def rotary_embedding(self, rotary_dim: int) -> nn.Module:
        """The rotary table every layer shares (Phi-3 builds its LongRoPE one)."""
        return RotaryEmbedding(rotary_dim, int(self.config.get("max_position_embeddings", 4096)), self.config)

    @property
    def local_kv_heads(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    @property
    def local_heads(self) -> int:
        return self.layers[0].self_attn.num_heads

    #: run the blocks as one C call where every part of them has a C kernel (cpu_decoder.py);
    #: tests and benchmarks turn it off to compare with, or time, the Python layers
    native_stack = True
    _native_plan: "NativeStack | None | bool" = False  # False: not built yet (weights may change)

    def weights_changed(self) -> None:
        self._native_plan = False  # built again from the packed (or quantized) weights
        for layer in self.layers:
            layer.__dict__.pop("_gemv_weights", None)  # looked at again (DecoderLayer.gemv_weights)

    def _native_blocks(self) -> NativeStack | None:
        """The layers as a :class:`NativeStack`: Llama-style blocks (no Q/K norm, the dense gated
        MLP) whose every linear layer runs a C kernel, on one rank."""
        if not self.native_stack or self.tp.size > 1 or not cpu_decoder.available():
            return None
        blocks, eps = [], set()
        for layer in self.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            plain = type(layer) is DecoderLayer and type(attn) is Attention
            if not (plain and attn.q_norm is None and type(mlp) is MLP):
                return None
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if not all(type(n) is RMSNorm for n in norms):
                return None
            eps |= {n.eps for n in norms}
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            # a LoRA-wrapped projection: the plan runs its base layer (base-only batches)
            linears = tuple(getattr(lin, "base_layer", lin) for lin in linears)
            blocks.append((attn.layer_id, *(n.weight for n in norms), *linears))
        return NativeStack.build(blocks, eps.pop()) if len(eps) == 1 else None

    def embed(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The input rows of the forward (vision-language models put their image rows in)."""
        return self.embed_tokens(input_ids)

    def rope_table(self, positions: torch.Tensor, ctx: ForwardContext, dtype: torch.dtype):
        """The forward's rotary (cos2, sin2) table, shared by every layer and the native stack
        (M-RoPE models build it from ``ctx.mm``'s three position axes)."""
        return self.rotary.table(positions, dtype)

    #: hidden states can be captured at layer inputs (``ctx.capture``, EAGLE-3's features)
    supports_feature_capture = True

    def forward(self, input_ids, positions, ctx):
        x, residual = self.embed(input_ids, ctx), None
        rope = self.rope_table(positions, ctx, x.dtype)
        capture = ctx.capture
        if capture is not None:  # the Python layers: the C stack keeps its states to itself
            for i, layer in enumerate(self.layers):
                capture.take(i, x, residual)
                x, residual = layer(x, residual, rope, ctx)
            capture.take(len(self.layers), x, residual)
            x, _ = self.norm(x, residual)
            return x
        plan = self._native_plan
        if plan is False:
            plan = self._native_plan = self._native_blocks()
        if plan is not None and plan.usable(x):
            # adapter rows run in the stack too, unless an adapter's weights cannot go there
            lora = None if ctx.lora is None else NativeLoRA.build(ctx.lora, x.shape[0], plan.n)
            in_stack = ctx.lora is None or lora is not None
            attend = ctx.attn.native_attend(rope, ctx.metadata) if in_stack else None
            if attend is not None:
                x, residual = plan.run(x, attend, lora)
                x, _ = self.norm(x, residual)
                return x
        for layer in self.layers:
            x, residual = layer(x, residual, rope, ctx)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden, deterministic=False):
        return self.lm_head(hidden, deterministic)

    def load_tensor(self, modules: dict, params: dict, name: str, tensor, fused: dict) -> tuple[str, str, int]:
        return place_tensor(self, modules, params, name, tensor, fused)


class DecoderLM(StackedLM):
    qkv_bias = False
    qk_norm = False
    supports_tp = True

    def __init__(self, config: dict, tp: TPGroup | None = None) -> None:
        super().__init__(config, tp)
        tp = self.tp
        hidden, vocab = config["hidden_size"], config["vocab_size"]
        self.embed_tokens = VocabEmbedding(vocab, hidden, tp)
        qkv_bias = bool(config.get("attention_bias", self.qkv_bias))
        self.layers = nn.ModuleList(self.build_layer(i, qkv_bias) for i in range(self.num_layers))
        self.finish_stack(config.get("rms_norm_eps", 1e-6), self.rotary_dim)

    @property
    def kv_windows(self) -> list[int | None]:
        # every layer is a K/V layer; a family's sliding layers carry their window (VariantAttention)
        return [getattr(layer.self_attn, "sliding_window", None) for layer in self.layers]

    @property
    def rotary_dim(self) -> int:
        """The rotated channels of each head (all of them but under partial rotary)."""
        return self.head_dim

    def build_layer(self, layer_id: int, qkv_bias: bool) -> nn.Module:
        """Decoder layer ``layer_id`` (families with another block build their own)."""
        c = self.config
        attn = self.build_attention(layer_id)
        return DecoderLayer(c, layer_id, self.head_dim, qkv_bias, self.qk_norm, self.tp, self.build_mlp(layer_id), attn)

    def build_attention(self, layer_id: int) -> nn.Module | None:
        """The attention of layer ``layer_id``; None: Llama's (:class:`Attention`)."""
        return None

    def build_mlp(self, layer_id: int) -> nn.Module | None:
        """The feed-forward block of layer ``layer_id``; None: the dense gated MLP."""
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._native_plan = False
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        fused = FUSED_PROJECTIONS
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if self.tie and name == "lm_head.weight":
                continue
            loaded.add(self.load_tensor(modules, params, name, tensor, fused))
        expected = set()
        for mname, module in modules.items():
            if isinstance(module, Linear):
                n_parts = len(module._row_map)
                expected |= {(mname, "weight", p) for p in range(n_parts)}
                if module.bias is not None:
                    expected |= {(mname, "bias", p) for p in range(n_parts)}
            elif isinstance(module, VocabEmbedding) and not mname.endswith(".proj"):
                expected.add((mname, "weight", 0))
            elif isinstance(module, LMHead) and module.tied is None:
                expected.add((mname, "weight", 0))
            elif isinstance(module, RMSNorm):
                expected.add((mname, "weight", 0))
        missing = sorted(f"{m}.{leaf}" for m, leaf, _ in expected - loaded)
        if missing:
            raise KeyError(f"checkpoint is missing weights: {missing[:5]}")
