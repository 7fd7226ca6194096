"""One LoRA adapter in PEFT's format, read and fitted to the model's (fused) projections.

PEFT saves ``adapter_config.json`` and ``adapter_model.safetensors`` with one ``lora_A`` ``[r, in]``
and ``lora_B`` ``[out, r]`` per adapted projection, named after the checkpoint's unfused modules
(``q_proj``, ``gate_proj`` ...). The model fuses Q/K/V and gate/up into one layer each, so the parts
of a fused layer are joined here: their A matrices stacked (``[parts * r, in]``) and their B
matrices placed block-diagonally in the fused output (``[out, parts * r]``, each part's B in its
own rows and its own rank columns). One shrink and one expand then adapt the whole fused layer,
and a part the adapter leaves out contributes nothing. The scale (``alpha / r``, or
``alpha / sqrt(r)`` under rsLoRA) is folded into B once, here.

Under ``--tp-size N`` each rank keeps the share of A and B that goes with its share of the layer:
B's rows of the output rows a column-parallel layer (QKV, gate-up) holds, A's columns of the input
columns a row-parallel layer (o_proj, down_proj) holds (see :class:`~llmkit.core.lora.layer.LoRALinear`
for where the row-parallel delta is summed).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

# checkpoint module -> (the model's layer, part of it): the fusion the decoder plugins load with
FUSED_PARTS = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
# Adapters of these change the vocabulary side of the model, which is not adapted per row here.
_REFUSED_TARGETS = ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out")
# The most one output of an adapted projection's delta may change by for an input whose entries
# are at most 1 (bounded by scale x ||B||_inf x ||A||_inf). A trained adapter's bound is in the
# tens to thousands; one far past this (weights of 1e18) overflows the activations to inf and NaN,
# and the model generates nothing.
MAX_DELTA = 1e6


@dataclass
class LoRAAdapter:
    """An adapter ready to serve: per adapted layer (``"layers.3.self_attn.qkv_proj"``) the stacked
    ``A [k, in]`` and the scaled block-diagonal ``B [out, k]``."""

    name: str
    path: str
    uid: int  # never reused: a reloaded adapter of the same name gets a fresh prefix-cache space
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # per layer, the ``(first output row, rows)`` of each part, in the order of A's rank blocks
    parts: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    native: object = None  # the C decoder stack's copy of the weights, built on first use


def read_adapter_config(path: Path) -> dict:
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise ValueError(f"LoRA adapter at '{path}': no adapter_config.json there")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"LoRA adapter at '{path}': adapter_config.json is not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter at '{path}': adapter_config.json is not an object")
    return cfg


def check_config(cfg: dict, where: str, max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scale, or a ValueError saying what llmkit does not serve."""
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{where}: peft_type '{cfg.get('peft_type')}' is not LORA")
    try:
        rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    except (KeyError, TypeError, ValueError, OverflowError):  # (OverflowError: r Infinity)
        raise ValueError(f"{where}: adapter_config.json has no valid 'r'") from None
    if rank <= 0:
        raise ValueError(f"{where}: rank {rank} is not positive")
    if rank > max_rank:
        raise ValueError(f"{where}: rank {rank} is over --max-lora-rank {max_rank}")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ValueError(f"{where}: per-module ranks or alphas ({key}) are not supported")
    if cfg.get("use_dora"):
        raise ValueError(f"{where}: DoRA adapters are not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{where}: adapters that train biases (bias='{cfg['bias']}') are not supported")
    if cfg.get("modules_to_save"):
        raise ValueError(f"{where}: modules_to_save {cfg['modules_to_save']} is not supported")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    for t in targets:
        if any(t.endswith(r) for r in _REFUSED_TARGETS):
            raise ValueError(f"{where}: embedding and LM-head adapters ('{t}') are not supported")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    if not math.isfinite(scale):
        raise ValueError(f"{where}: lora_alpha {cfg.get('lora_alpha')} makes the scale {scale}, not a finite number")
    return rank, scale


# where vision-language checkpoints keep their image encoder and projector
_VISION_PREFIXES = ("visual.", "vision_tower.", "vision_model.", "multi_modal_projector.")


def _module_of(key: str) -> tuple[str, str, str]:
    """``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` ->
    ``("layers.0.self_attn", "q_proj", "lora_A")``."""
    parts = key.split(".")
    if len(parts) < 4 or parts[-1] != "weight":
        raise ValueError(f"unexpected tensor '{key}'")
    owner = ".".join(parts[:-3]).removeprefix("base_model.model.").removeprefix("model.")
    # a vision-language model's decoder: model.language_model.layers (transformers 5) or
    # language_model.model.layers (4.x, LLaVA and Gemma 3 checkpoints)
    for prefix in ("language_model.model.", "language_model."):
        if owner.startswith(prefix):
            return owner.removeprefix(prefix), parts[-3], parts[-2]
    return owner, parts[-3], parts[-2]


def read_tensors(path: Path, where: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise ValueError(f"{where}: no adapter_model.safetensors there (.bin adapters are not read)")
    try:
        return load_file(str(file), device="cpu")
    except Exception as exc:  # safetensors raises its own error types for a truncated or corrupt file
        raise ValueError(f"{where}: adapter_model.safetensors cannot be read ({exc})") from None


def build_adapter(
    name: str, path: str, uid: int, layers: dict, *, max_rank: int, allowed: frozenset[str], dtype, device
) -> LoRAAdapter:
    """Read the adapter at ``path`` and fit it to ``layers`` (fused layer name -> its
    :class:`Linear`). Every problem is a ValueError naming the adapter; nothing is half built."""
    where = f"LoRA adapter '{name}' at '{path}'"
    try:  # the path is a client's (the load route): any OSError of reading it is its mistake
        root = Path(path).expanduser()  # (RuntimeError: a ~user that does not exist)
        if not root.is_dir():
            raise ValueError(f"{where}: not a directory")
        rank, scale = check_config(read_adapter_config(root), where, max_rank)
        tensors = read_tensors(root, where)
    except (OSError, RuntimeError) as exc:
        raise ValueError(f"{where}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    pairs: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        try:
            owner, module, kind = _module_of(key)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if owner.startswith(_VISION_PREFIXES):
            raise ValueError(
                f"{where}: it adapts the vision encoder ('{owner}.{module}'); only the language model's "
                "projections take adapters"
            )
        if kind in ("lora_embedding_A", "lora_embedding_B") or module in _REFUSED_TARGETS:
            raise ValueError(f"{where}: embedding and LM-head adapters ('{key}') are not supported")
        if kind not in ("lora_A", "lora_B"):
            raise ValueError(f"{where}: unexpected tensor '{key}'")
        if module not in FUSED_PARTS:
            raise ValueError(f"{where}: target module '{module}' is not one of {', '.join(FUSED_PARTS)}")
        if module not in allowed:
            raise ValueError(f"{where}: target module '{module}' is outside --lora-target-modules")
        pairs.setdefault((owner, module), {})[kind] = t
    if not pairs:
        raise ValueError(f"{where}: the file holds no LoRA weights")
    fused: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (owner, module), ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"{where}: {owner}.{module} lacks its lora_A or lora_B")
        target, part = FUSED_PARTS[module]
        layer_name = f"{owner.rpartition('.')[0]}.{target}"  # layers.0.self_attn + q_proj -> ...qkv_proj
        if not owner.endswith("." + target.split(".")[0]):
            layer_name = ""  # q_proj outside self_attn: not this architecture's layout
        if layer_name not in layers:
            raise ValueError(f"{where}: the model has no layer '{owner}.{module}' (another architecture?)")
        fused.setdefault(layer_name, {})[part] = (ab["lora_A"], ab["lora_B"])
    weights = {n: _fuse(where, n, layers[n], parts, rank, scale, dtype, device) for n, parts in fused.items()}
    layout = {n: [_part_rows(layers[n], p) for p in sorted(parts)] for n, parts in fused.items()}
    return LoRAAdapter(name, str(path), uid, rank, weights, layout)


def _part_rows(layer, part: int) -> tuple[int, int]:
    """``(first output row, rows)`` of ``part`` of a fused layer (as :func:`_fuse` places its B)."""
    lo, hi, dst = layer._row_map[part]
    return dst, hi - lo


def _fuse(where, name, layer, parts: dict, rank: int, scale: float, dtype, device):
    """Stacked A and block-diagonal, scaled B for ``layer`` from its parts' ``(A, B)``, split over
    the tensor-parallel ranks as the layer is: a column-parallel layer's B keeps the output rows
    this rank holds of each part (the rows the base layer loads, at the same local offsets); a
    row-parallel layer's A keeps this rank's input columns. With one rank nothing is cut."""
    order = sorted(parts)
    cols = layer._cols
    a = torch.zeros(len(order) * rank, layer.local_in, dtype=torch.float32)
    b = torch.zeros(layer.local_out, len(order) * rank, dtype=torch.float32)
    for i, part in enumerate(order):
        pa, pb = parts[part]
        lo, hi, dst = layer._row_map[part]
        rows = layer.part_rows[part]
        if tuple(pa.shape) != (rank, layer.in_features) or tuple(pb.shape) != (rows, rank):
            raise ValueError(
                f"{where}: {name} part {part} has A {tuple(pa.shape)} and B {tuple(pb.shape)}, but the base "
                f"model needs A ({rank}, {layer.in_features}) and B ({rows}, {rank}) (another base model?)"
            )
        if not (torch.isfinite(pa).all() and torch.isfinite(pb).all()):
            raise ValueError(f"{where}: {name} part {part} holds NaN or infinite values")
        # the whole part's bound, the same on every tensor-parallel rank (float64: no overflow)
        bound = abs(scale) * pb.double().abs().sum(1).max().item() * pa.double().abs().sum(1).max().item()
        if not bound <= MAX_DELTA:
            raise ValueError(
                f"{where}: {name} part {part}: its delta could reach {bound:.3g} for inputs at most 1 "
                f"(scale {scale:.3g} x its largest B row x its largest A row; at most {MAX_DELTA:g}): "
                "its outputs would overflow"
            )
        a[i * rank : (i + 1) * rank] = pa[:, cols].float()
        b[dst : dst + hi - lo, i * rank : (i + 1) * rank] = pb[lo:hi].float() * scale
    a, b = a.to(dtype=dtype), b.to(dtype=dtype)  # the scale folded in, at the model's precision
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise ValueError(f"{where}: {name}: its weights times the scale {scale:.3g} are not finite in {dtype}")
    return a.to(device=device).contiguous(), b.to(device=device).contiguous()
