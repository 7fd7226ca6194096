"""``--speculative-algorithm MTP``: DeepSeek-V3/R1's own multi-token-prediction layer drafts.

DeepSeek-V3 ships ``num_nextn_predict_layers`` (1) extra decoder layer after its last one
(``model.layers.{L}.*``, which the target's loader skips). It reads ``[enorm(embed(token)),
hnorm(hidden)]`` through ``eh_proj`` into a full decoder block (MLA attention and the MoE) and
predicts with ``shared_head`` (a norm and an LM head): ``hidden`` is the target's output state (after
its final norm) at the position before the token, then the layer's own output for each further
draft token, as SGLang and vLLM run it. The weights are read from the target's checkpoint, or from
``--speculative-draft-model-path`` where they were split out; the embedding is the target's (under
``--tp-size N``, the copy gathered for rank 0, which drafts alone; the layer is whole there).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from llmkit.core.model.causal_lm import ForwardContext
from llmkit.core.model.decoder.deepseek import DecoderLayer, check_config, fp8_dequantized, place_decoder_tensor
from llmkit.core.model.layers import RMSNorm
from llmkit.core.model.linear import Linear
from llmkit.core.model.loader.source import iter_safetensors, load_config, materialize
from llmkit.core.model.parallel import SINGLE
from llmkit.plugins.speculative.draft_cache import DraftAttention, DraftKV
from llmkit.plugins.speculative.head_files import target_embedding
from llmkit.plugins.speculative.hidden_draft import HiddenStateProposer

log = logging.getLogger("llmkit")


class LatentDraftAttention(DraftAttention):
    """MLA over the draft's own cache: the cached key is the latent (plus its rotary part) and the
    value is the latent alone, as the target's latent K/V pool keeps them."""

    def __init__(self, scale: float, v_dim: int) -> None:
        super().__init__(scale)
        self.v_dim = v_dim

    def forward(self, q, k, v, layer_id, metadata: DraftKV, *, sliding_window=None, sinks=None):
        return super().forward(q, k, k[..., : self.v_dim], layer_id, metadata)


class MTPLayer(nn.Module):
    def __init__(self, target, config: dict, target_vocab=None) -> None:
        super().__init__()
        hidden, eps = int(config["hidden_size"]), float(config.get("rms_norm_eps", 1e-6))
        # Whole on rank 0 (only it drafts): under tensor parallelism a block split like the
        # target's would wait in its all-reduces for ranks that never run it.
        self.block = DecoderLayer(config, target.num_layers, SINGLE, target.version)
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.head_norm = RMSNorm(hidden, eps)
        self.head = nn.Linear(hidden, int(config["vocab_size"]), bias=False)
        self.attention = LatentDraftAttention(target.attention_scale, int(config["kv_lora_rank"]))
        self._target = (target, target_embedding(target, target_vocab, "MTP"))  # shared, not submodules

    def forward(self, hidden, tokens, positions, kv: DraftKV, from_target: bool):
        target, embed = self._target
        if from_target:  # the captured state is the last layer's output before the final norm
            hidden = target.norm(hidden)
        emb = embed(tokens).masked_fill((positions == 0)[:, None], 0)  # (as vLLM: none at 0)
        x = self.eh_proj(torch.cat((self.enorm(emb), self.hnorm(hidden)), dim=-1))
        h, residual = self.block(x, None, target.rotary.table(positions, x.dtype), ForwardContext(self.attention, kv))
        return h + residual

    def scores(self, out: torch.Tensor) -> torch.Tensor:
        return self.head(self.head_norm(out))


# the MTP layer's own tensors (after ``model.layers.{L}.``) -> this module's
_OWN = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "head_norm.weight",
    "shared_head.head.weight": "head.weight",
}


class MTPProposer(HiddenStateProposer):
    reads_target_vocab = True

    def __init__(
        self,
        draft_model_path: str | None = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        target_model=None,
        target_model_path: str | None = None,
        target_vocab=None,
        **options,
    ) -> None:
        super().__init__(**options)
        target = target_model
        if target is None or not hasattr(target, "version") or not getattr(target, "supports_feature_capture", False):
            raise ValueError("MTP speculation needs a DeepSeek-V3/R1-style target (its multi-token-prediction layer)")
        path = Path(draft_model_path or target_model_path or "").expanduser()
        if not (path / "config.json").exists():
            raise ValueError(
                f"MTP: no config.json in {path} (--speculative-draft-model-path or the target's directory)"
            )
        config = load_config(path)
        if "rope_interleave" in target.config:  # (set by the target's class for V2: rotate as it does)
            config["rope_interleave"] = target.config["rope_interleave"]
        if not int(config.get("num_nextn_predict_layers") or 0):
            raise ValueError(f"MTP: {path} has no multi-token-prediction layer (num_nextn_predict_layers is 0)")
        check_config(config, target.version, "MTP")  # (the layer's checkpoint may be split out of the target's)
        self.feature_layers = (target.num_layers,)
        self.device = torch.device(device)
        self.max_position = int(config.get("max_position_embeddings", 1 << 30))
        self.layer = MTPLayer(target, config, target_vocab)
        _load(self.layer, path, target.num_layers, config)
        self.layer.to(device=self.device, dtype=dtype).eval()
        log.info("MTP draft layer: layer %d of %s", target.num_layers, path)

    def draft_layer(self, hidden, tokens, positions, kv, from_target: bool):
        return self.layer(hidden, tokens, positions, kv, from_target)

    def draft_scores(self, out):
        return self.layer.scores(out)


def _load(layer: MTPLayer, path: Path, index: int, config: dict) -> None:
    """Layer ``index``'s tensors from the checkpoint at ``path`` into ``layer`` (lazily read: a
    671B checkpoint's other tensors are never loaded). Block-scaled FP8 weights (DeepSeek's own
    checkpoints) are dequantized at load, as the target's are."""
    prefix = f"model.layers.{index}."
    modules, params = dict(layer.named_modules()), dict(layer.named_parameters())
    seen: set[str] = set()
    tensors = (
        (n[len(prefix) :], materialize(t))
        for n, t in iter_safetensors(path, lazy=True)
        if n.startswith(prefix) and n != prefix + "embed_tokens.weight"  # (a copy of the target's: never read)
    )
    for name, tensor in fp8_dequantized(tensors, config):
        if name in _OWN:
            with torch.no_grad():
                params[_OWN[name]].copy_(tensor)
            seen.add(_OWN[name])
            continue
        try:
            key = place_decoder_tensor(layer, modules, params, "block." + name, tensor)
        except KeyError:
            raise ValueError(f"MTP: unexpected tensor {prefix}{name}") from None
        if key is not None:
            seen.add(key)
    missing = sorted(n for n in _OWN.values() if n not in seen)
    if not any(n.startswith("block.") for n in seen):
        missing.append(f"{prefix}* (the decoder block)")
    if missing:
        raise ValueError(f"MTP: the checkpoint at {path} is missing {', '.join(missing[:5])}")
    for module in layer.modules():
        if isinstance(module, Linear):
            module.finalize()
    layer.block.self_attn.absorb()
