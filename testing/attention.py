"""An attention backend (``llmkit_register_attention_backends``) against the reference backend.

:func:`check_against_reference` runs a backend class and the reference (the backend registered as
``torch``, looked up in the plugin registry) on the same paged batch, one :class:`Case` at a time,
and asserts that the new tokens' K/V land in the pool at ``out_slots`` and that the outputs agree.
:data:`CASES` covers prefill (with and without cached prefixes, pages shared as after a radix-cache
hit), decode and mixed batches, and each optional feature (sliding window, sinks, latent KV, V heads
of another size) where the backend lists it in ``features``. :class:`AttentionBackendContract` runs
them as pytest tests: subclass it with a ``backend_class`` fixture::

    import pytest
    from llmkit.testing.attention import AttentionBackendContract

    class TestMyBackend(AttentionBackendContract):
        @pytest.fixture
        def backend_class(self):
            return MyAttentionBackend

(override the ``device`` and ``dtype`` fixtures to run elsewhere than fp32 on the CPU).
:func:`build_batch` builds the batches the way the engine does (a real :class:`KVCachePool`, its
pages handed out in a shuffled order, random cached prefixes), for a backend's own tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from llmkit.core.kvcache.kv_pool import KVCachePool, ReqToTokenPool
from llmkit.core.model.attention import LATENT_KV, SINKS, SLIDING_WINDOW, AttentionBackend, AttentionMetadata
from llmkit.core.plugins import registry

#: the reference backend's name in the plugin registry
REFERENCE = "torch"
#: the largest absolute difference allowed between a backend's outputs and the reference's, by dtype
TOLERANCE = {torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


@dataclass
class Batch:
    pool: KVCachePool
    req_pool: ReqToTokenPool
    md: AttentionMetadata
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor | None  # None: latent KV (the values are the keys' first channels)


def make_metadata(
    *,
    q_lens: list[int],
    kv_lens: list[int],
    rows: list[int],
    req_to_token: torch.Tensor,
    out_slots: torch.Tensor,
    page_size: int,
    deterministic: bool = False,
    decoding: list[bool] | None = None,
) -> AttentionMetadata:
    """AttentionMetadata with every field filled as the engine fills it (``decoding``: which
    sequences are decode rows; by default none is flagged)."""
    dev = req_to_token.device
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    i64 = dict(dtype=torch.int64, device=dev)
    return AttentionMetadata(
        num_seqs=len(q_lens),
        q_lens=list(q_lens),
        kv_lens=list(kv_lens),
        q_start_loc=torch.tensor(starts, **i64),
        q_lens_t=torch.tensor(q_lens, **i64),
        kv_lens_t=torch.tensor(kv_lens, **i64),
        req_pool_indices=torch.tensor(rows, **i64),
        req_to_token=req_to_token,
        out_slots=out_slots.to(dev),
        page_size=page_size,
        is_decode=all(n == 1 for n in q_lens),
        deterministic=deterministic,
        decoding=list(decoding or []),
    )


def build_batch(
    seqs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    num_layers: int = 1,
    share: dict[int, tuple[int, int]] | None = None,
    deterministic: bool = False,
    seed: int = 0,
    latent: bool = False,
    v_head_dim: int | None = None,
) -> Batch:
    """A batch of ``seqs`` = [(prefix_len, new_len), ...].

    ``share[i] = (j, n)``: sequence i's first ``n`` tokens (a multiple of ``page_size``, at most
    both prefixes) live in sequence j's pages (j < i), as after a radix-cache prefix match.
    ``latent``: a pool without V buffers and ``v`` None, as MLA's latent KV; ``v_head_dim``: V heads
    of another size than K's.
    """
    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    share = share or {}
    max_ctx = max(p + n for p, n in seqs) + page_size
    need = sum(-(-(p + n) // page_size) for p, n in seqs) + 4
    pool = KVCachePool(
        num_layers=num_layers,
        num_pages=need + 1,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        v_head_dim=0 if latent else v_head_dim,
    )
    # Scramble the free list so neighbouring tokens do not sit in neighbouring pages.
    pages = pool.allocate(pool.capacity_pages)
    pool.free([pages[i] for i in torch.randperm(len(pages), generator=g).tolist()])
    req_pool = ReqToTokenPool(len(seqs) + 2, max_ctx, device)
    req_pool.allocate()  # row 0 stays unused, so rows != sequence indices

    rows, seq_pages, out_slots = [], [], []
    for i, (prefix, new) in enumerate(seqs):
        row = req_pool.allocate()
        owned: list[int] = []
        if i in share:
            j, n = share[i]
            assert n % page_size == 0 and n <= prefix and n <= seqs[j][0] and j < i
            owned = seq_pages[j][: n // page_size]
        total_pages = -(-(prefix + new) // page_size)
        owned = owned + pool.allocate(total_pages - len(owned))
        slots = pool.page_slots(owned)[: prefix + new].to(device)
        req_pool.table[row, : prefix + new] = slots
        rows.append(row)
        seq_pages.append(owned)
        out_slots.append(slots[prefix:])
    for i, (prefix, _) in enumerate(seqs):  # shared slots are written twice: same last value wins
        slots = req_pool.table[rows[i], :prefix]
        for layer in range(num_layers):
            for buf in (pool.k_buffers[layer], *pool.v_buffers[layer : layer + 1]):
                buf[slots] = torch.randn((prefix, num_kv_heads, buf.shape[-1]), generator=g).to(buf)

    t = sum(n for _, n in seqs)
    q = torch.randn((t, num_heads, head_dim), generator=g).to(device=device, dtype=dtype)
    k = torch.randn((t, num_kv_heads, head_dim), generator=g).to(device=device, dtype=dtype)
    dv = v_head_dim or head_dim
    v = None if latent else torch.randn((t, num_kv_heads, dv), generator=g).to(device=device, dtype=dtype)
    md = make_metadata(
        q_lens=[n for _, n in seqs],
        kv_lens=[p + n for p, n in seqs],
        rows=rows,
        req_to_token=req_pool.table,
        out_slots=torch.cat(out_slots),
        page_size=page_size,
        deterministic=deterministic,
    )
    return Batch(pool, req_pool, md, q, k, v)


def backend_kwargs(batch: Batch, num_heads: int, v_head_dim: int | None = None) -> dict:
    """Constructor arguments of an AttentionBackend for ``batch`` (``v_head_dim``: the output's head
    size when it differs from the keys', as with a latent KV)."""
    k = batch.pool.k_buffers[0]
    kwargs = dict(num_heads=num_heads, num_kv_heads=k.shape[1], head_dim=k.shape[2], pool=batch.pool, device=k.device)
    if v_head_dim:
        kwargs["v_head_dim"] = v_head_dim
    return kwargs


@dataclass(frozen=True)
class Case:
    """One batch: ``seqs`` = [(cached prefix, new tokens), ...]; ``share`` as in :func:`build_batch`;
    ``window``/``sinks``/``latent``/``v_head_dim`` ask for the optional features (``latent``: the
    values are the keys' first ``latent`` channels)."""

    name: str
    seqs: tuple[tuple[int, int], ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    share: dict[int, tuple[int, int]] = field(default_factory=dict)
    window: int | None = None
    sinks: bool = False
    latent: int | None = None
    v_head_dim: int | None = None
    layers: int = 1  # the forward runs on the last layer

    @property
    def features(self) -> frozenset[str]:
        """The optional backend features the case needs."""
        needs = {SLIDING_WINDOW: self.window, SINKS: self.sinks, LATENT_KV: self.latent}
        return frozenset(f for f, wanted in needs.items() if wanted)


CASES: tuple[Case, ...] = (
    # prefill: ragged prompts, one with a cached prefix; then prompts sharing a cached prefix's pages
    Case("prefill", ((0, 19), (0, 6), (9, 7)), num_heads=8, num_kv_heads=2, head_dim=32, page_size=4),
    Case(
        "prefill_shared_prefix",
        ((12, 6), (14, 17), (9, 3)),
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        page_size=4,
        share={1: (0, 12), 2: (0, 8)},
    ),
    # decode: one new token a sequence, contexts across page boundaries, a shared prefix
    Case(
        "decode",
        ((40, 1), (3, 1), (70, 1), (0, 1)),
        num_heads=8,
        num_kv_heads=1,
        head_dim=32,
        page_size=1,
        share={2: (0, 37)},
    ),
    Case("decode_pages", ((15, 1), (32, 1), (4, 1)), num_heads=14, num_kv_heads=2, head_dim=16, page_size=16),
    # mixed: prompt rows beside decode rows in one forward, on the second of two layers
    Case("mixed", ((0, 9), (21, 1), (7, 3), (30, 1)), num_heads=6, num_kv_heads=3, head_dim=24, page_size=4, layers=2),
    # the optional features, run where the backend lists them
    Case("mixed_window", ((0, 19), (21, 5), (33, 1)), num_heads=4, num_kv_heads=2, head_dim=16, page_size=4, window=6),
    Case("mixed_sinks", ((0, 11), (21, 1), (5, 4)), num_heads=4, num_kv_heads=1, head_dim=16, page_size=4, sinks=True),
    Case("mixed_latent", ((0, 9), (25, 1), (6, 5)), num_heads=8, num_kv_heads=1, head_dim=40, page_size=4, latent=32),
    Case("mixed_v_head_dim", ((0, 7), (19, 1)), num_heads=4, num_kv_heads=2, head_dim=24, page_size=4, v_head_dim=16),
)


def reference_backend() -> type[AttentionBackend]:
    """The reference backend class: the one registered as :data:`REFERENCE` (``torch``)."""
    return registry().attention_backend(REFERENCE)


def _forward_options(case: Case, device) -> dict:
    """The case's window, and random per-head sinks (fp32, spread wide enough that some outweigh
    every key and some do not)."""
    options = {}
    if case.window:
        options["sliding_window"] = case.window
    if case.sinks:
        g = torch.Generator().manual_seed(1)
        options["sinks"] = (torch.randn(case.num_heads, generator=g) * 3).to(device)
    return options


def check_against_reference(
    backend_class: type[AttentionBackend],
    case: Case,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    tolerance: float | None = None,
    configure=None,
) -> None:
    """Run ``case`` through a ``backend_class`` instance and the reference; raise AssertionError,
    naming the case, where the new K/V are not in the pool or the outputs differ by more than
    ``tolerance`` (by default :data:`TOLERANCE`'s for ``dtype``). ``configure(backend)``: set a
    backend up after it is built (a tuning knob a test wants pinned)."""
    missing = case.features - (backend_class.features & reference_backend().features)
    assert not missing, f"{case.name}: {backend_class.__name__} does not implement {sorted(missing)}"
    device = torch.device(device)
    b = build_batch(
        list(case.seqs),
        num_heads=case.num_heads,
        num_kv_heads=case.num_kv_heads,
        head_dim=case.head_dim,
        page_size=case.page_size,
        dtype=dtype,
        device=device,
        num_layers=case.layers,
        share=dict(case.share),
        latent=case.latent is not None,
        v_head_dim=case.v_head_dim,
    )
    b.md.decoding = [new == 1 and prefix > 0 for prefix, new in case.seqs]  # as the engine flags its rows
    kwargs = backend_kwargs(b, case.num_heads, case.latent or case.v_head_dim)
    backend, reference = backend_class(**kwargs), reference_backend()(**kwargs)
    if configure is not None:
        configure(backend)
    layer, options = case.layers - 1, _forward_options(case, device)
    out = backend.forward(b.q, b.k, b.v, layer, backend.prepare_metadata(b.md), **options)
    where = f"{case.name} ({backend_class.__name__}, {str(dtype).removeprefix('torch.')})"
    dv = case.latent or case.v_head_dim or case.head_dim
    assert tuple(out.shape) == (b.q.shape[0], case.num_heads, dv), f"{where}: output shape {tuple(out.shape)}"
    slots = b.md.out_slots
    assert torch.equal(b.pool.k_buffers[layer][slots], b.k), f"{where}: the new K are not in the pool"
    if b.v is not None:
        assert torch.equal(b.pool.v_buffers[layer][slots], b.v), f"{where}: the new V are not in the pool"
    b.md.extra.clear()  # the backend's precomputed tensors: the reference builds its own
    want = reference.forward(b.q, b.k, b.v, layer, reference.prepare_metadata(b.md), **options)
    err = (out.float() - want.float()).abs().max().item()
    bound = TOLERANCE[dtype] if tolerance is None else tolerance
    assert err <= bound, f"{where}: outputs differ from the reference's by up to {err:.3g} > {bound}"


class AttentionBackendContract:
    """The :data:`CASES` as pytest tests; a subclass provides the ``backend_class`` fixture (and may
    override ``device``, ``dtype`` and ``configure``). A case whose features the backend does not
    list is skipped, as is every case where the backend's ``availability`` names a reason."""

    @pytest.fixture
    def device(self) -> str:
        return "cpu"

    @pytest.fixture
    def dtype(self) -> torch.dtype:
        return torch.float32

    @pytest.fixture
    def configure(self):
        """``configure(backend)`` after the backend is built; None: as built."""
        return None

    @pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
    def test_matches_the_reference(self, backend_class, case, device, dtype, configure):
        reason = backend_class.availability(torch.device(device))
        if reason:
            pytest.skip(f"{backend_class.__name__} is not available on {device}: {reason}")
        missing = case.features - backend_class.features
        if missing:
            pytest.skip(f"{backend_class.__name__} does not implement {', '.join(sorted(missing))}")
        check_against_reference(backend_class, case, device=device, dtype=dtype, configure=configure)
