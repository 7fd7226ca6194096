"""Whether a model's sliding-window layers keep only their window, and how one memory budget is
split between their pool and the full layers' (``core/kvcache/window_pages.py``).

The budget is what the pool would take with full-length K/V in every layer (``--max-total-tokens``
and ``--mem-fraction-static`` keep their meaning as memory). The window pool gets what the running
requests can hold at once: each its window and two pages, plus a prefill chunk and the drafts in
flight; the full layers get the rest, so they hold more tokens than before in the same memory.
"""

from __future__ import annotations

import logging

log = logging.getLogger("llmkit")


def window_layers(plan, config, model, tp) -> tuple[list[int], int] | None:
    """The K/V layers whose pages are kept apart and the largest of their windows, or None (every
    layer keeps full-length K/V: no window layer, ``--swa-full``, or a path that reads one slot
    table for every layer, logged)."""
    windows = model.kv_windows
    layers = [i for i, w in enumerate(windows) if w]
    if not layers or config.swa_full:
        return None
    why = None
    if tp is not None and tp.size > 1:
        why = "tensor parallelism replays one slot table on every rank"
    elif config.speculative_algorithm and (config.speculative_eagle_topk or 1) > 1:
        why = "tree drafts move K/V through the full layers' slot table"
    elif (
        plan.device.type == "cuda"
        and not config.disable_cuda_graph
        and model.supports_cuda_graph
        and plan.attn_cls.supports_cuda_graph
    ):
        why = "captured CUDA graphs read one slot table (add --disable-cuda-graph to free window pages)"
    if why:
        log.info("window layers keep full-length K/V: %s", why)
        return None
    return layers, max(w for w in windows if w)


# The window pool is balanced for requests this many windows long: shorter ones run out of window
# pages first (and wait, or preempt, as for full pages), longer ones out of full pages.
BALANCE_WINDOWS = 8
# The most token slots the slot table of a model without full layers gets (an int64 each, 32 MiB).
ALL_WINDOW_SLOTS = 1 << 22


def split_budget(
    tokens: int, layer_bytes: list[int], windowed: tuple[list[int], int], config, running: int, max_context: int
) -> tuple[int, int]:
    """(full layers' tokens, window layers' tokens) from the memory of ``tokens`` full-length tokens
    (``layer_bytes``: each K/V layer's bytes a token). The window pool holds what the running
    requests can hold at once (each its window and two pages, the drafts, a prefill chunk), at
    most the window's share for requests :data:`BALANCE_WINDOWS` windows long, and at least one
    request's window and chunk."""
    layers, window = windowed
    page = config.page_size
    win_b = sum(layer_bytes[i] for i in layers)
    full_b = sum(layer_bytes) - win_b
    budget = tokens * sum(layer_bytes)
    drafts = config.speculative_num_draft_tokens if config.speculative_algorithm else 0
    held = window + 2 * page + drafts  # what a running request holds
    want = running * held + config.chunked_prefill_size
    ratio = held / min(max_context, BALANCE_WINDOWS * window)  # window tokens a full token, balanced
    balanced = int(ratio * budget / (full_b + ratio * win_b)) if full_b else tokens
    least = config.chunked_prefill_size + held + 2 * page
    window_tokens = -(-min(tokens, max(min(want, balanced), least)) // page) * page
    if not full_b:
        # every layer a window (Mistral 7B v0.1): the full slot table holds no K/V, only positions,
        # so it is sized for every running request at full context, not by memory
        return max(tokens, min(running * max_context, ALL_WINDOW_SLOTS)), window_tokens
    return max((budget - window_tokens * win_b) // full_b, tokens), window_tokens
