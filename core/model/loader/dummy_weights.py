"""Random weights for ``--load-format dummy`` (as in vLLM and SGLang).

Benchmarks need a model's real shapes, not its trained values: with dummy weights an 8B model
runs from its config.json and tokenizer alone, with no checkpoint to download or store.
"""

from __future__ import annotations

import torch
from torch import nn

from llmkit.core.model.layers import RMSNorm


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int = 0, low: float = -1e-3, high: float = 1e-3) -> None:
    """Fill every floating parameter of ``model`` in place with uniform(low, high) values, the
    same for the same seed; RMSNorm scales are set to 1.0 so activations keep a sane magnitude.

    Values are drawn on each parameter's own device, one parameter at a time, so a model on a GPU
    never needs a host copy of its weights.
    """
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    gens: dict[torch.device, torch.Generator] = {}
    for _, p in model.named_parameters():  # a fixed order: the same values for the same seed
        if not p.is_floating_point():
            continue
        if id(p) in norms:
            p.fill_(1.0)
            continue
        gen = gens.get(p.device)
        if gen is None:
            gen = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        p.uniform_(low, high, generator=gen)
