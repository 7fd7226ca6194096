"""``TransformersForCausalLM``: any decoder-only ``transformers`` model on llmkit's engine.

The long tail of architectures runs through transformers' own modeling code (as vLLM's and
SGLang's Transformers backends do): llmkit registers an attention function, ``"llmkit"``, in
transformers' ``AttentionInterface`` and builds the model with it, so every attention layer hands
its rotated queries, keys and values to the engine's :class:`AttentionBackend`, which writes the
K/V into the paged pool and attends over the sequence's cached context. The step's tokens, all
sequences concatenated, go through the model as one row of ``T`` tokens with their own positions;
no transformers cache or mask is built (the backend knows each sequence's bounds). So continuous
batching, chunked prefill, the prefix cache, sampling, structured output and the parsers apply
unchanged.

What it lacks against a native class: the C decoder stack and the fused CPU kernels, llmkit's
quantized linear layers (``--quantization``), tensor parallelism, CUDA graphs, LoRA adapters and
speculative decoding. A model whose attention does not go through the interface, keeps another
cache (state-space layers), adds ALiBi biases or soft-caps its attention logits is refused at
start with the reason (``unsupported_reason``).
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from llmkit.core.model.attention import SLIDING_WINDOW
from llmkit.core.model.causal_lm import CausalLM, ForwardContext

log = logging.getLogger(__name__)

IMPL = "llmkit"  # the attn_implementation name registered in transformers

# config fields whose presence means a cache or bias the engine's attention cannot provide
_REFUSED_FIELDS = {
    "alibi": "ALiBi position biases",
    "attn_logit_softcapping": "soft-capped attention logits",
    "mamba_expand": "state-space (Mamba) layers",
    "ssm_state_size": "state-space layers",
    "linear_attn_config": "linear-attention layers",
}


# Model types whose greedy tokens on the fallback differ from transformers' in
# benchmarks/model_coverage.py for a reason not found yet: refused rather than served wrong.
_DIVERGING = {
    "granite_swa": "GraniteSwa",
    "granitemoe_swa": "GraniteMoeSwa",
    "modernbert-decoder": "ModernBertDecoder",
}


def _attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature: ``query [1, H, T, D]``, ``key``/``value``
    ``[1, Hkv, T, D]``; returns ``([1, T, H, D], None)``."""
    ctx = kwargs.get("llmkit_ctx")
    if ctx is None:  # (the probe at start meets this first: refused there)
        raise ValueError(f"{type(module).__name__} does not pass the forward's keyword arguments to its attention")
    if isinstance(ctx, _Probe):
        return ctx.record(module, query, key, value, scaling)
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    q = query[0].transpose(0, 1)
    if scaling is not None and scaling != ctx.attn.scale:  # (OPT scales its queries itself: 1.0)
        q = q * (scaling / ctx.attn.scale)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    out = ctx.attn.forward(
        q.contiguous(), k.contiguous(), v.contiguous(), module.layer_idx, ctx.metadata, sliding_window=window or None
    )
    return out.unsqueeze(0), None


class _Probe:
    """Stands in for the forward context in one 2-token forward at start: records what each
    attention layer hands the interface (its heads, K/V heads, head size and softmax scale), which
    no config field states for every model (multi-query GPT-BigCode, OPT's pre-scaled queries)."""

    def __init__(self) -> None:
        self.layers: dict[int, tuple[int, int, int, int, float | None]] = {}

    def record(self, module, query, key, value, scaling):
        idx = getattr(module, "layer_idx", None)
        if idx is None:
            raise ValueError(f"{type(module).__name__} calls the attention interface without a layer_idx")
        if key.shape[-1] != query.shape[-1] or value.shape[1] != key.shape[1]:
            raise ValueError(f"{type(module).__name__}: queries, keys and values of different head sizes")
        if int(idx) in self.layers:  # (DiffLlama: two attentions over one layer's cache)
            raise ValueError(f"{type(module).__name__} calls the attention interface twice in one layer")
        self.layers[int(idx)] = (query.shape[1], key.shape[1], key.shape[-1], value.shape[-1], scaling)
        out = torch.zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1], dtype=query.dtype)
        return out.to(query.device), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPL, _attend)


def hf_config_of(config: dict):
    from transformers import AutoConfig

    cfg = dict(config)
    model_type = cfg.pop("model_type")
    return AutoConfig.for_model(model_type, **cfg)


def causal_lm_class(config: dict):
    """The transformers class for ``config`` (its ``architectures[0]`` if transformers has it, else
    the causal LM of its model type), or None."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    for name in list(config.get("architectures") or []) + [
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type", ""))
    ]:
        if name in causal and hasattr(transformers, name):
            return getattr(transformers, name)
    return None


def unsupported_reason(config: dict) -> str | None:
    """Why the fallback cannot serve ``config``; None if it can."""
    cls = causal_lm_class(config)
    if cls is None:
        return f"transformers {_version()} has no causal LM class for model_type '{config.get('model_type')}'"
    if not cls.is_backend_compatible():
        return f"{cls.__name__} does not route its attention through transformers' attention interface"
    if config.get("model_type") in _DIVERGING:
        return (
            f"{cls.__name__}'s tokens on the fallback differ from transformers' (benchmarks/model_coverage.py); "
            "refused until that is understood"
        )
    if config.get("is_encoder_decoder"):
        return f"{cls.__name__} is an encoder-decoder model"
    for field, what in _REFUSED_FIELDS.items():
        if config.get(field):
            return f"{cls.__name__} uses {what} ('{field}' in config.json), which llmkit's attention does not run"
    types = set(config.get("layer_types") or ())
    other = types - {"full_attention", "sliding_attention", "attention", "chunked_attention"}
    if other:
        return f"{cls.__name__} has layers of kind {sorted(other)}: only attention layers run in the fallback"
    if getattr(cls, "_is_stateful", False):
        return f"{cls.__name__} keeps a recurrent state, which the fallback does not cache"
    return None


def _version() -> str:
    import transformers

    return transformers.__version__


class TransformersForCausalLM(CausalLM):
    """A transformers causal LM whose attention layers read and write llmkit's paged pool."""

    is_fallback = True  # (the docs' support table)
    # the torch backend has it; "auto" falls back to torch when the chosen backend lacks it
    attention_features = frozenset({SLIDING_WINDOW})
    supports_cuda_graph = False

    @staticmethod
    def unsupported(config: dict) -> str | None:
        return unsupported_reason(config)

    @staticmethod
    def architecture(config: dict) -> str:
        """The transformers class this serves (config.json may name none)."""
        return causal_lm_class(config).__name__

    def __init__(self, config: dict, tp=None) -> None:
        super().__init__(config, tp)
        why = unsupported_reason(config)
        if why:
            raise ValueError(f"the transformers fallback cannot serve this model: {why}")
        from transformers.initialization import no_init_weights

        _register()
        cls = causal_lm_class(config)
        hf_cfg = hf_config_of(config)
        hf_cfg._attn_implementation = IMPL
        with no_init_weights():  # the checkpoint overwrites every parameter
            self.hf = cls._from_config(hf_cfg, attn_implementation=IMPL, dtype=torch.get_default_dtype())
        self.hf_config = self.hf.config
        try:
            self._probe_layers(cls.__name__)
        except ValueError as exc:
            msg = str(exc)
            prefix = "the transformers fallback cannot serve"
            raise ValueError(msg if msg.startswith(prefix) else f"{prefix} {cls.__name__}: {msg}") from None
        log.info("%s runs on the transformers fallback (no native llmkit class)", cls.__name__)

    def _probe_layers(self, name: str) -> None:
        """One 2-token forward records every attention layer's shapes: the engine has one head
        count, K/V head count and head size for all of them (a layer whose softmax scale differs
        has its queries rescaled in ``_attend``), and every layer must reach the interface."""
        probe = _Probe()
        with torch.no_grad():
            dev = next(self.hf.parameters()).device
            ids = torch.zeros(1, 2, dtype=torch.long, device=dev)
            self.hf.base_model(
                input_ids=ids, position_ids=torch.arange(2, device=dev)[None], use_cache=False, llmkit_ctx=probe
            )
        n = int(self.hf_config.num_hidden_layers)
        if sorted(probe.layers) != list(range(n)):
            raise ValueError(
                f"the transformers fallback cannot serve {name}: {n - len(probe.layers)} of its {n} layers do not "
                "attend through transformers' attention interface"
            )
        shapes = {v[:4] for v in probe.layers.values()}
        if len(shapes) > 1:
            raise ValueError(
                f"the transformers fallback cannot serve {name}: its attention layers differ in shape "
                f"(heads, K/V heads, key and value sizes: {sorted(shapes)})"
            )
        self._heads, self._kv_heads, self._head_dim, v_dim = shapes.pop()
        if v_dim != self._head_dim:
            raise ValueError(f"the transformers fallback cannot serve {name}: value heads of another size")
        scale = probe.layers[0][4]
        self._scale = float(scale) if scale is not None else self._head_dim**-0.5

    # -- the contract's shapes, from the instantiated config (its attribute maps read n_layer etc.)
    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        return self._kv_heads

    @property
    def local_heads(self) -> int:
        return self._heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def attention_scale(self) -> float:
        return self._scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        out = self.hf.base_model(
            input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False, llmkit_ctx=ctx
        )
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        # the scalings transformers' causal LM heads apply after the projection
        logits = self.hf.get_output_embeddings()(hidden).float()
        c = self.hf_config
        if getattr(c, "logit_scale", None):  # Cohere
            logits = logits * c.logit_scale
        if getattr(c, "logits_scaling", None):  # Granite
            logits = logits / c.logits_scaling
        if getattr(c, "final_logit_softcapping", None):
            cap = c.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_checkpoint_dir(self, model_dir) -> None:
        """Load through transformers' own ``from_pretrained``: its key renamings and tensor
        conversions (MoE experts fused into one tensor at load) apply as they do in transformers."""
        first = next(self.hf.parameters())
        old, self.hf = self.hf, None
        del old  # (its parameters freed before the checkpoint's are allocated)
        cls = causal_lm_class(self.config)
        self.hf = cls.from_pretrained(
            str(model_dir), config=self.hf_config, attn_implementation=IMPL, dtype=first.dtype,
            device_map={"": first.device},
        ).eval()  # fmt: skip
        self.hf_config = self.hf.config

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint names go through transformers' own renamings (its conversion mapping: legacy
        names, a missing or extra base-model prefix); a checkpoint that needs one of its tensor
        conversions (experts fused at load) is refused, naming the tensor."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        transforms = get_model_conversion_mapping(self.hf)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        params = dict(self.hf.named_parameters())
        params.update(self.hf.named_buffers())
        prefix = self.hf.base_model_prefix
        seen = set()
        for key, tensor in weights:
            name, converted = rename_source_key(key, renamings, converters, prefix, params)
            if converted is not None:
                raise ValueError(
                    f"{key}: this checkpoint needs transformers' weight conversion to {name}, which the "
                    "transformers fallback does not run"
                )
            target = params.get(name)
            if target is None:
                continue  # unused checkpoint entries (rotary tables saved by old exports)
            if target.shape != tensor.shape:
                raise ValueError(f"{key}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(tensor)
            seen.add(name)
        self.hf.tie_weights()
        missing = sorted(n for n, _ in self.hf.named_parameters() if n not in seen)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} weights of the model, e.g. {missing[:3]}")
