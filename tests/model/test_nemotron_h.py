"""Nemotron-H: Mamba2 layers (their state the convolution's last inputs and an fp32 SSM matrix per
head) beside attention without rotary embeddings and ReLU² feed-forwards, through the same state
pool and state-aware prefix cache as the other hybrids. The SSD kernels against transformers'
torch forms; the real engine's greedy output against transformers' ``generate`` (prompts batched,
chunked, a conversation resumed from a snapshot); a layer pattern that disagrees with the weights
fails naming the layer."""

from __future__ import annotations

import torch

from llmkit.core.model.hybrid import ssd


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + 11 * i) % 509 + 1 for i in range(n)]


def _scan_inputs(T: int, R: int = 1, H: int = 6, P: int = 4, G: int = 3, N: int = 5):
    """Random scan inputs for ``R`` sequences of ``T`` tokens: ``dt`` already through softplus,
    ``A`` negative, three groups of B/C shared by two heads each."""
    g = torch.Generator().manual_seed(T * 7 + R)
    x = torch.randn(R, T, H, P, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(R, T, H, generator=g))
    A = -torch.rand(H, generator=g) * 2 - 0.1
    B, C = torch.randn(R, T, G, N, generator=g), torch.randn(R, T, G, N, generator=g)
    D = torch.randn(H, generator=g)
    state = torch.randn(R, H, P, N, generator=g)
    return x, dt, A, B, C, D, state


def test_chunked_scan_matches_transformers_from_a_state():
    """The chunked form from a nonzero state, its chunks of 4 not dividing 11 tokens, equals
    transformers' ``mamba2_chunk_scan`` (its chunks of 8), outputs and final state."""
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    x, dt, A, B, C, D, state = _scan_inputs(11)
    ref, ref_state = mamba2_chunk_scan(x, dt, A, B, C, 8, D=D, initial_states=state, return_final_states=True)
    y, s = ssd.chunked(x[0], dt[0], A, B[0], C[0], D, state[0], chunk=4)
    torch.testing.assert_close(y, ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, ref_state[0], atol=1e-4, rtol=1e-4)


def test_chunked_in_two_equals_one_pass_and_none_is_zeros():
    """A sequence scanned in two calls (the state carried) equals one pass; None starts from zeros."""
    x, dt, A, B, C, D, _ = _scan_inputs(23)
    whole, s_whole = ssd.chunked(x[0], dt[0], A, B[0], C[0], D, None, chunk=8)
    a, s = ssd.chunked(x[0, :9], dt[0, :9], A, B[0, :9], C[0, :9], D, torch.zeros(6, 4, 5), chunk=8)
    b, s = ssd.chunked(x[0, 9:], dt[0, 9:], A, B[0, 9:], C[0, 9:], D, s, chunk=8)
    torch.testing.assert_close(torch.cat([a, b]), whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, s_whole, atol=1e-4, rtol=1e-4)


def test_recurrent_matches_transformers_and_continues_the_chunked_form():
    """The recurrent step of three rows equals transformers' ``mamba2_selective_state_update``; a
    prompt's chunked state followed by recurrent steps equals one chunked pass."""
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_selective_state_update

    x, dt, A, B, C, D, state = _scan_inputs(1, R=3)
    P, N = x.shape[-1], B.shape[-1]
    ref_state = state.clone()
    ref = mamba2_selective_state_update(
        ref_state,
        x[:, 0],
        dt[:, 0, :, None].expand(-1, -1, P),
        A[:, None, None].expand(-1, P, N),
        B[:, 0],
        C[:, 0],
        D[:, None].expand(-1, P),
    )
    y, s = ssd.recurrent(x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D, state)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, ref_state, atol=1e-5, rtol=1e-5)

    x, dt, A, B, C, D, _ = _scan_inputs(14)
    whole, s_whole = ssd.chunked(x[0], dt[0], A, B[0], C[0], D, None, chunk=4)
    rows, s = [], None
    _, s = ssd.chunked(x[0, :10], dt[0, :10], A, B[0, :10], C[0, :10], D, None, chunk=4)
    s = s[None]
    for t in range(10, 14):
        o, s = ssd.recurrent(x[:, t], dt[:, t], A, B[:, t], C[:, t], D, s)
        rows.append(o)
    torch.testing.assert_close(torch.cat(rows), whole[10:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s[0], s_whole, atol=1e-4, rtol=1e-4)
