"""How a state layer splits a forward's rows: one-token sequences (decode steps) run together in
the recurrent form; each longer one (a prompt chunk) runs alone from its own state."""

from __future__ import annotations

import itertools


def split_rows(md) -> tuple[list[int], list[int], list[tuple[int, int, int]]]:
    """For ``md`` (the forward's attention metadata): each sequence's first row, the one-token
    sequences' indices, and ``(sequence, first row, end row)`` of every longer one."""
    q_lens = md.q_lens
    starts = md.q_starts or list(itertools.accumulate(q_lens, initial=0))
    ones = [i for i, n in enumerate(q_lens) if n == 1]
    spans = [(i, starts[i], starts[i] + n) for i, n in enumerate(q_lens) if n != 1]
    return starts, ones, spans
