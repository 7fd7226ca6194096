"""Where a checkpoint's tensors land in a decoder stack's parameters: fused projections take their
part, tensor-parallel layers their rank's slice; and which weights a checkpoint must give."""

from __future__ import annotations

from torch import nn

from llmkit.core.model.linear import Linear, LMHead, VocabEmbedding
from llmkit.core.model.loader.source import materialize

# A checkpoint's separate projections and the fused layer (and part) each loads into.
FUSED_PROJECTIONS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def place_tensor(model, modules: dict, params: dict, name: str, tensor, fused: dict) -> tuple[str, str, int]:
    """Put one checkpoint tensor where it belongs: a (fused) linear layer keeps its rank's
    slice, the embedding or LM head its vocabulary rows, anything else is copied whole.
    ``fused`` maps a checkpoint projection name to ``(fused layer, part)``. Returns
    ``(module, leaf, part)`` for the missing-weights check."""
    parts = name.split(".")
    owner, leaf = ".".join(parts[:-1]), parts[-1]
    part = 0
    if len(parts) >= 2 and parts[-2] in fused:
        target, part = fused[parts[-2]]
        owner = ".".join(parts[:-2] + [target])
    module = modules.get(owner)
    if isinstance(module, Linear) and leaf in ("weight", "bias"):
        module.load(tensor, part)
    elif isinstance(module, (VocabEmbedding, LMHead)) and leaf == "weight":
        module.load(tensor)
    elif name in params:
        params[name].data.copy_(materialize(tensor))
    else:
        raise KeyError(f"unexpected weight '{name}' for {type(model).__name__}")
    return owner, leaf, part


def expected_weights(model: nn.Module) -> set[tuple[str, int]]:
    """Every (parameter, part) a checkpoint must give ``model``: each part of a fused projection
    (its ``(module.leaf, part)`` pairs as :func:`place_tensor` returns them), the LM head once."""
    modules, out = dict(model.named_modules()), set()
    for p in dict(model.named_parameters()):
        if p.startswith("lm_head."):
            out.add(("lm_head.weight", 0))
            continue
        owner, leaf = p.rsplit(".", 1)
        module = modules[owner]
        parts = len(module._row_map) if isinstance(module, Linear) and leaf in ("weight", "bias") else 1
        out |= {(p, i) for i in range(parts)}
    return out


def check_loaded(model: nn.Module, loaded: set[tuple[str, int]]) -> None:
    """Raise naming the first weights :func:`expected_weights` wants that ``loaded`` lacks (experts
    are checked by their :class:`~llmkit.core.model.moe.FusedExperts`, which count their own)."""
    from llmkit.core.model.moe import FusedExperts

    missing = sorted({p for p, part in expected_weights(model) if ".experts." not in p and (p, part) not in loaded})
    for name, module in model.named_modules():
        if isinstance(module, FusedExperts):
            missing += [f"{name}.{m}" for m in module.missing()]
    if missing:
        raise KeyError(f"checkpoint is missing weights: {missing[:5]}")
