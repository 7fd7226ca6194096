"""A process's place in a tensor-parallel group, passed explicitly to the layers that shard.

With one rank every collective is the identity, so single-process models pay nothing for being
written TP-ready. With N ranks the collectives run on a ``torch.distributed`` process group (gloo on
CPU, NCCL on GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed ProcessGroup; None with one rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``, in rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def units(self, total: int, what: str) -> tuple[int, int]:
        """This rank's range ``[lo, hi)`` of ``total`` units (heads, channels) split evenly.

        When there are fewer units than ranks (4 KV heads on 8 ranks), the ranks share them:
        rank r holds unit ``r * total // size``, replicated, as SGLang and vLLM do for KV heads.
        """
        if total >= self.size:
            if total % self.size:
                raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {self.size}")
            n = total // self.size
            return self.rank * n, (self.rank + 1) * n
        if self.size % total:
            raise ValueError(f"the tensor-parallel size {self.size} is not a multiple of {what} ({total})")
        u = self.rank * total // self.size
        return u, u + 1


SINGLE = TPGroup()
