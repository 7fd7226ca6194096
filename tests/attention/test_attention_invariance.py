"""The torch attention backend's rows hold still bit for bit: a prompt row equals itself however
the prompt was split between the prefix cache and this step (down to the last token alone, as on a
cache hit) and whatever else is in the batch; a decode row equals itself alone, in a padded decode
batch, and in a mixed batch. Through the quantized kernels' int8 activation blocks any ulp of
difference can change a token, so streaming = non-streaming and seeded repeatability across
prefix-cache hits rest on this.
Every result is also checked against a float64 reference."""

from __future__ import annotations

import pytest
import torch

from llmkit.core.kvcache.kv_pool import KVCachePool, ReqToTokenPool
from llmkit.plugins.attention import cpu_attention
from llmkit.plugins.attention.torch_backend import TorchAttentionBackend

from attention_utils import make_metadata

# four sequences; the first crosses the prompt chunk size twice, and the C kernel's key chunk
# (cpu_attention.c's KV_CHUNK, 256): its late rows combine two chunks, and the windowed ones'
# 40 keys straddle the chunk boundary
LENS = (300, 77, 9, 140)
SHAPES = {
    "gqa": dict(heads=9, kv_heads=3, dim=64),  # SmolLM2's layout
    "mha": dict(heads=4, kv_heads=4, dim=32),
    "mqa-window-sinks": dict(heads=6, kv_heads=1, dim=16, window=40, sinks=True),
    "latent": dict(heads=4, kv_heads=1, dim=48, v_dim=32),  # MLA: values are the keys' first channels
}


NATIVE = cpu_attention.available(torch.float32, torch.device("cpu"))
# decode rows: the C kernel (where it builds) and the padded-GEMM fallback
DECODE_PATHS = [pytest.param(True, marks=pytest.mark.skipif(not NATIVE, reason="no C kernel here")), False]


class Setup:
    def __init__(
        self, heads, kv_heads, dim, v_dim=None, window=None, sinks=False, native=NATIVE, dtype=torch.float32, lens=LENS
    ):
        g = torch.Generator().manual_seed(0)
        self.window, self.latent = window, v_dim is not None
        self.sinks = torch.randn(heads, generator=g) if sinks else None
        page = 4
        pages = sum(-(-n // page) for n in lens) + 2
        self.pool = KVCachePool(
            num_layers=1,
            num_pages=pages,
            page_size=page,
            num_kv_heads=kv_heads,
            head_dim=dim,
            dtype=dtype,
            device=torch.device("cpu"),
            v_head_dim=0 if self.latent else None,
        )
        self.req_pool = ReqToTokenPool(len(lens) + 1, max(lens) + page, torch.device("cpu"))
        self.req_pool.allocate()  # row 0 unused
        self.rows, self.slots, self.q, self.k, self.v = [], [], [], [], []
        for n in lens:
            row = self.req_pool.allocate()
            slots = self.pool.page_slots(self.pool.allocate(-(-n // page)))[:n]
            self.req_pool.table[row, :n] = slots
            self.rows.append(row)
            self.slots.append(slots)
            self.q.append(torch.randn(n, heads, dim, generator=g))
            self.k.append(torch.randn(n, kv_heads, dim, generator=g))
            self.v.append(None if self.latent else torch.randn(n, kv_heads, v_dim or dim, generator=g))
        self.attn = TorchAttentionBackend(
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=dim,
            pool=self.pool,
            device=torch.device("cpu"),
            v_head_dim=v_dim,
        )
        self.attn._native = native

    def batch(self, parts: list[tuple[int, int, int]]):
        """``(q, k, v, metadata, q_lens, positions)`` of one forward over ``(sequence, first, end)``
        parts: the outputs of positions ``first..end-1`` with keys ``0..end-1``. A sequence given as
        ``-(i + 1)`` is sequence i's decode row (one generated token); otherwise the part is prompt rows."""
        q_lens, kv_lens, rows, slots, decoding, qs, ks, vs, pos = [], [], [], [], [], [], [], [], []
        for seq, first, end in parts:
            dec = seq < 0
            seq = abs(seq) - 1 if dec else seq
            q_lens.append(end - first)
            kv_lens.append(end)
            rows.append(self.rows[seq])
            slots.append(self.slots[seq][first:end])
            decoding.append(dec)
            qs.append(self.q[seq][first:end])
            ks.append(self.k[seq][first:end])
            vs.append(None if self.latent else self.v[seq][first:end])
            pos.append(torch.arange(first, end))
        md = make_metadata(
            q_lens=q_lens,
            kv_lens=kv_lens,
            rows=rows,
            req_to_token=self.req_pool.table,
            out_slots=torch.cat(slots),
            page_size=self.pool.page_size,
            decoding=decoding,
        )
        md = self.attn.prepare_metadata(md)
        v = None if self.latent else torch.cat(vs)
        return torch.cat(qs), torch.cat(ks), v, md, q_lens, torch.cat(pos)

    def run(self, parts: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """One forward over ``parts`` (see :meth:`batch`): each part's outputs."""
        q, k, v, md, q_lens, _ = self.batch(parts)
        out = self.attn.forward(q, k, v, 0, md, sliding_window=self.window, sinks=self.sinks)
        return list(out.split(q_lens))

    def reference(self, seq: int) -> torch.Tensor:
        """Causal attention over the whole sequence in float64."""
        q, k = self.q[seq].double(), self.k[seq].double()
        v = k[..., : self.attn.v_head_dim] if self.latent else self.v[seq].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * self.attn.scale
        n = q.shape[0]
        pos = torch.arange(n)
        hidden = pos[None, :] > pos[:, None]
        if self.window:
            hidden |= pos[None, :] <= pos[:, None] - self.window
        scores = scores.masked_fill(hidden, float("-inf"))
        if self.sinks is not None:
            scores = torch.cat([self.sinks.double().view(-1, 1, 1).expand(-1, n, 1), scores], dim=-1)
            probs = torch.softmax(scores, dim=-1)[..., 1:]
        else:
            probs = torch.softmax(scores, dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("native", DECODE_PATHS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_rows_do_not_depend_on_the_split_or_the_batch(shape, native):
    s = Setup(**SHAPES[shape], native=native)
    full = s.run([(i, 0, n) for i, n in enumerate(LENS)])  # every prompt prefilled at once
    for i, n in enumerate(LENS):
        torch.testing.assert_close(full[i].double(), s.reference(i), atol=1e-5, rtol=1e-5)
    assert torch.equal(s.run([(0, 0, LENS[0])])[0], full[0])  # alone
    n0 = LENS[0]
    for cut in (1, 5, 127, 128, 129, 200, n0 - 2, n0 - 1):  # a cached prefix of `cut` tokens
        alone = s.run([(0, cut, n0)])[0]
        assert torch.equal(alone, full[0][cut:]), cut
        # beside another prompt and two decode rows
        mixed = s.run([(-2, 60, 61), (0, cut, n0), (3, 100, LENS[3]), (-3, 8, 9)])
        assert torch.equal(mixed[1], full[0][cut:]), cut
        assert torch.equal(mixed[2], full[3][100:]), cut


@pytest.mark.parametrize("native", DECODE_PATHS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_decode_rows_do_not_depend_on_the_batch(shape, native):
    s = Setup(**SHAPES[shape], native=native)
    s.run([(i, 0, n - 1) for i, n in enumerate(LENS)])  # the prompts' K/V
    alone = [s.run([(-(i + 1), n - 1, n)])[0] for i, n in enumerate(LENS)]
    for i in range(len(LENS)):
        ref = s.reference(i)[-1:]
        torch.testing.assert_close(alone[i].double(), ref, atol=1e-5, rtol=1e-5)
    together = s.run([(-(i + 1), n - 1, n) for i, n in enumerate(LENS)])  # padded to the longest
    pair = s.run([(-3, LENS[2] - 1, LENS[2]), (-2, LENS[1] - 1, LENS[1])])
    mixed = s.run([(0, 50, 120), (-3, LENS[2] - 1, LENS[2]), (-4, LENS[3] - 1, LENS[3])])
    for i in range(len(LENS)):
        assert torch.equal(together[i], alone[i]), i
    assert torch.equal(pair[0], alone[2]) and torch.equal(pair[1], alone[1])
    assert torch.equal(mixed[1], alone[2]) and torch.equal(mixed[2], alone[3])


@pytest.mark.skipif(not NATIVE, reason="no C kernel here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_decode_kernel_matches_the_gemm_path_in_every_pool_dtype(shape, dtype):
    """The C kernel and the padded GEMMs read the same stored K/V (widened exactly to fp32), so they
    differ only in summation order; and the kernel's rows do not depend on the thread count. The
    kernel writes 16- and 32-bit pools itself, byte for byte what torch's conversion writes."""
    fast, ref = Setup(**SHAPES[shape], dtype=dtype), Setup(**SHAPES[shape], native=False, dtype=dtype)
    for s in (fast, ref):
        s.run([(i, 0, n - 1) for i, n in enumerate(LENS)])
    decode = [(-(i + 1), n - 1, n) for i, n in enumerate(LENS)]
    got, want = fast.run(decode), ref.run(decode)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-5)
    slots = torch.cat(fast.slots)
    bufs = [(fast.pool.k_buffers[0], ref.pool.k_buffers[0])]
    bufs += [] if fast.latent else [(fast.pool.v_buffers[0], ref.pool.v_buffers[0])]
    assert all(torch.equal(a[slots].view(torch.uint8), b[slots].view(torch.uint8)) for a, b in bufs)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = fast.run(decode)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(alone, got))


@pytest.mark.skipif(not NATIVE, reason="no C kernel here")
@pytest.mark.parametrize("shape", list(SHAPES))
def test_with_the_c_kernel_a_prompt_row_equals_the_decode_row_at_its_position(shape):
    """Preemption recomputes generated tokens as prompt rows, and the prefix cache serves K/V that
    decoding wrote to later prompts: both rest on this."""
    s = Setup(**SHAPES[shape])
    prompt = s.run([(i, 0, n) for i, n in enumerate(LENS)])
    for i, n in enumerate(LENS):
        for pos in (0, n // 2, n - 1):
            assert torch.equal(s.run([(-(i + 1), pos, pos + 1)])[0][0], prompt[i][pos]), (i, pos)


@pytest.mark.skipif(not NATIVE, reason="no C kernel here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["gqa", "mha"])
def test_the_fused_qkv_path_is_rotate_then_forward_bit_for_bit(shape, dtype):
    """``forward_qkv`` rotates the queries and new keys itself (a decode layer's one attention call):
    the same outputs and the same pool bytes as rotating in torch and calling ``forward``."""
    from llmkit.core.model.layers import RotaryEmbedding

    fused, plain = Setup(**SHAPES[shape], dtype=dtype), Setup(**SHAPES[shape], dtype=dtype)
    rope = RotaryEmbedding(fused.q[0].shape[-1], 512, {"rope_theta": 10000.0})
    outs = []
    for s in (fused, plain):
        s.run([(2, 0, 8)])  # the decode row's earlier keys (unrotated here: only equality matters)
        q, k, v, md, _, pos = s.batch([(0, 0, 50), (1, 0, 77), (-3, 8, 9)])  # two prompts, a decode row
        table = rope.table(pos, torch.float32)
        if s is fused:
            qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
            outs.append(s.attn.forward_qkv(qkv, table, 0, md))
        else:
            outs.append(s.attn.forward(RotaryEmbedding.rotate(q, table), RotaryEmbedding.rotate(k, table), v, 0, md))
    assert outs[0] is not None and torch.equal(outs[0], outs[1])
    slots = torch.cat([fused.slots[0][:50], fused.slots[1][:77], fused.slots[2][:9]])
    for a, b in (
        (fused.pool.k_buffers[0], plain.pool.k_buffers[0]),
        (fused.pool.v_buffers[0], plain.pool.v_buffers[0]),
    ):
        assert torch.equal(a[slots].view(torch.uint8), b[slots].view(torch.uint8))


@pytest.mark.skipif(not NATIVE, reason="no C kernel here")
@pytest.mark.parametrize("shape", ["gqa", "mqa-window-sinks"])
def test_a_long_prompt_in_many_key_chunks(shape):
    """A 2,400-token prompt at once: its rows take up to 10 key chunks, and more chunked rows than
    the kernel holds partial results for at a time (PART_TASKS), so they go in several waves. Rows
    still equal the decode row at their position and the float64 reference."""
    n = 2400
    s = Setup(**SHAPES[shape], lens=(n,))
    prompt = s.run([(0, 0, n)])[0]
    torch.testing.assert_close(prompt.double(), s.reference(0), atol=1e-5, rtol=1e-5)
    for pos in (255, 256, 1000, n - 1):
        assert torch.equal(s.run([(-1, pos, pos + 1)])[0][0], prompt[pos]), pos
