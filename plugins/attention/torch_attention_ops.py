"""The padded, block-ordered GEMM pieces of the ``torch`` attention backend (``torch_backend.py``
says why rows are padded to :data:`_ROWS` and keys to whole :data:`_KEY_BLOCK` blocks: so a row's
result does not depend on its batch)."""

from __future__ import annotations

import torch

_ROWS = 4  # GEMM row counts are padded to a multiple of this (see above)
# a prompt chunk's GEMM has at least this many rows: MKL takes another kernel for fewer when the
# head is wide (4 rows at head_dim 96-128, 4-12 at MLA's 576), so a prefix-cache hit's lone last
# token would differ from the same row in a full prefill
_MIN_PROMPT_ROWS = 16
_CHUNK = 128  # prompt positions per GEMM: bounds the score matrix and skips most masked keys
_KEY_BLOCK = 256  # keys per probability-times-value GEMM


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _rows(n: int) -> int:
    """``n`` GEMM rows padded to a multiple of :data:`_ROWS`."""
    return _round_up(n, _ROWS)


def _blocks(n: int) -> int:
    """``n`` keys rounded up to whole key blocks."""
    return _round_up(n, _KEY_BLOCK)


def _weighted_values(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``probs [B, R, n] @ values [B, n, Dv]`` key block by key block, in order (``n`` whole blocks)."""
    out = torch.bmm(probs[..., :_KEY_BLOCK], values[:, :_KEY_BLOCK])
    for b in range(_KEY_BLOCK, probs.shape[-1], _KEY_BLOCK):
        out.add_(torch.bmm(probs[..., b : b + _KEY_BLOCK], values[:, b : b + _KEY_BLOCK]))
    return out


def _head_rows(slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Rows of a ``[slots * Hkv, D]`` view of the pool for ``slots [..., n]``, heads before tokens
    (``[..., Hkv, n]`` flattened): one row gather then yields each head's keys contiguously (far
    faster than selecting along a transposed view, or gathering tokens and transposing after)."""
    heads = torch.arange(num_kv_heads, device=slots.device)
    return (slots.unsqueeze(-2) * num_kv_heads + heads[:, None]).reshape(-1)


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim; ``sinks`` (broadcast to ``scores[..., :1]``) join as a first
    column (first, so a row's reduction order does not depend on how many masked keys follow it)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    full = torch.cat([sinks.expand(*scores.shape[:-1], 1), scores], dim=-1)
    return torch.softmax(full, dim=-1)[..., 1:]


def _table_rows(req_to_token: torch.Tensor, rows: list[int], width: int, device) -> torch.Tensor:
    """The slot table's ``rows``, ``width`` wide; past the table's end (padding) slot 0."""
    table = req_to_token[torch.tensor(rows, device=device), : min(width, req_to_token.shape[1])]
    if table.shape[1] < width:
        table = torch.cat([table, table.new_zeros(len(rows), width - table.shape[1])], dim=1)
    return table


def _padded_slots(req_to_token: torch.Tensor, row: int, kv_len: int) -> torch.Tensor:
    """A sequence's slots, padded with slot 0 (never handed out: finite, and masked) to whole key blocks."""
    slots = req_to_token[row, :kv_len]
    return torch.cat([slots, slots.new_zeros(_blocks(kv_len) - kv_len)])


def _same_tensor(t: torch.Tensor | None, values: list[int], device) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device``, or ``t`` where it already is that (the model runner
    uploads these vectors with the metadata; building them again cost a step two list copies)."""
    if (
        t is not None
        and t.device == torch.device(device)
        and t.dtype == torch.int64
        and t.dim() == 1
        and len(t) == len(values)
    ):
        return t
    return torch.tensor(values, device=device)
