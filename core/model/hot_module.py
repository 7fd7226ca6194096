"""A base for the modules a decode step calls hundreds of times."""

from __future__ import annotations

from torch import nn


class HotModule(nn.Module):
    """``module(...)`` calls ``forward`` directly, skipping ``nn.Module.__call__``'s hook machinery.

    That machinery costs ~1.5 us a call on the project's 2-core CPU; a Llama-style layer makes
    nine such calls (norms, projections, attention, MLP), so 30 layers pay ~0.4 ms a decode step for
    hooks nobody registered. The price: forward hooks registered on these modules do not run (wrap
    or replace ``forward`` instead, as ``benchmarks/profile_decode_step.py`` does)."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)
