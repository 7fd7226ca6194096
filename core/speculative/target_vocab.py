"""The target's token embedding and LM head as whole tables on rank 0, for draft heads under tensor
parallelism.

A draft head (EAGLE's, EAGLE-3's, an MTP layer) looks its tokens up in the target's embedding and
EAGLE's projects onto the target's LM head. Under ``--tp-size N`` both are split by vocabulary
rows over the ranks, and only rank 0 drafts, so it cannot call them alone: their forwards are
collectives. At start every rank takes part in reading them out once, through the target's own
forwards (whatever their weight format: dense, GGUF blocks, ``--quantization``), and rank 0 keeps
dense copies. The cost is a second copy of both tables on rank 0 (for Llama-3.1-8B in bf16, 1 GB
each; a tied head shares the embedding's).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("llmkit")

_ROWS = 4096  # ids read out per collective (4096 x hidden floats at a time)
_HEAD_BYTES = 256 << 20  # the identity rows' logits per collective: rows x vocab fp32


class TargetVocab(nn.Module):
    """Dense copies of the target's embedding ``[vocab, hidden]`` and LM head weight (None: tied,
    the embedding's)."""

    def __init__(self, embed: torch.Tensor, head: torch.Tensor | None) -> None:
        super().__init__()
        self.embed = nn.Embedding.from_pretrained(embed, freeze=True)
        self.head = self.embed.weight if head is None else nn.Parameter(head, requires_grad=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the target's vocabulary, as the target's ``compute_logits`` (without a
        final soft-cap: no model with one has draft heads)."""
        return F.linear(hidden.to(self.head.dtype), self.head).float()


@torch.no_grad()
def gather_target_vocab(model, leader: bool, dtype: torch.dtype) -> TargetVocab | None:
    """Every rank calls this at the same point of start-up; rank 0 gets the tables, the others None."""
    vocab, hidden = int(model.config["vocab_size"]), int(model.config["hidden_size"])
    device = next(model.parameters()).device
    embed = []
    for lo in range(0, vocab, _ROWS):  # the embedding's forward all-reduces each id's row
        rows = model.embed_tokens(torch.arange(lo, min(vocab, lo + _ROWS), device=device))
        if leader:
            embed.append(rows.to(dtype))
    head = None
    if model.lm_head.tied is None:  # identity rows through the head: its all-gathered logits are W^T
        cols, step = [], max(1, _HEAD_BYTES // (4 * vocab))
        for lo in range(0, hidden, step):
            n = min(hidden, lo + step) - lo
            eye = torch.zeros(n, hidden, device=device)
            eye[torch.arange(n), torch.arange(lo, lo + n)] = 1.0
            part = model.lm_head(eye, True)
            if leader:
                cols.append(part.to(dtype))
        if leader:
            head = torch.cat(cols).t().contiguous()
    if not leader:
        return None
    table = torch.cat(embed)
    log.info(
        "draft head: the target's embedding%s gathered on rank 0 (%.1f MB)",
        "" if head is None else " and LM head",
        (table.numel() + (0 if head is None else head.numel())) * table.element_size() / 1e6,
    )
    return TargetVocab(table, head)
