"""Gemma 3 against transformers: the text model (sliding and global layers, a prompt longer than
the window) and the multimodal one with zero, one and two images through the paged KV path, the
image rows handed over as the engine does (pseudo-ids, ``ctx.mm``, ``bidirectional_spans``); the
processor against transformers' ``Gemma3Processor``; the torch backend's bidirectional spans
against a dense mask."""

from __future__ import annotations

import pytest
import torch

from llmkit.core.kvcache.kv_pool import KVCachePool, ReqToTokenPool
from llmkit.core.model.attention import BIDIRECTIONAL_SPANS, AttentionMetadata
from llmkit.core.model.causal_lm import ForwardContext
from llmkit.core.multimodal.forward import MultimodalForward
from llmkit.core.multimodal.items import is_pseudo, pseudo_id
from llmkit.plugins.attention.torch_backend import TorchAttentionBackend

import gemma3_utils as g3
from model_utils import load_ours
from paged_runner import PagedRunner, assert_close, check_cached_prefix_chunked_decode

pytest.importorskip("PIL")


# --- the text model ---------------------------------------------------------------------------


def test_text_model_matches_transformers(tmp_path):
    """Prefill (51 tokens, past the window of 8), a shared prefix prefilled in chunks beside
    decode steps, then batched decode: every step's logits equal transformers'."""
    ref = g3.save_tiny_gemma3_text(tmp_path)
    model = load_ours(tmp_path)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert [a.sliding_window for a in (layer.self_attn for layer in model.layers)] == [8, 8, None]
    ids = [(37 * i + 11) % g3.VOCAB for i in range(56)]
    check_cached_prefix_chunked_decode(model, ref, ids, page_size=4)


def test_text_model_final_logit_softcapping(tmp_path):
    ref = g3.save_tiny_gemma3_text(tmp_path, final_logit_softcapping=3.0)
    model = load_ours(tmp_path)
    ids = [(13 * i + 5) % g3.VOCAB for i in range(20)]
    runner = PagedRunner(model, 4)
    (ours,) = runner.step([(runner.new_seq(), ids)])
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    assert theirs.abs().max() < 3.0
    assert_close(ours, theirs)


# --- the multimodal model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("gemma3_vl")
    ref = g3.save_tiny_gemma3(path)
    model = load_ours(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    proc = type(model).processor(str(path), model.config, tok)
    return path, ref, model, tok, proc


def _prompt(tok, proc, n_images: int, text: str = "what is in the pictures?"):
    """Chat-template ids of a user turn with ``n_images`` image parts, expanded; and the items."""
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    text_ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    if not isinstance(text_ids, list):
        text_ids = text_ids["input_ids"]
    items = [proc.preprocess(g3.random_image(seed)) for seed in range(n_images)]
    ids, mm = proc.expand(list(text_ids), items)
    return ids, mm


class MMRunner(PagedRunner):
    """:class:`PagedRunner` with the engine's image plumbing: image tokens carry pseudo-ids, a
    forward's ``ctx.mm`` holds its image rows' encoder output, and ``bidirectional_spans`` each
    sequence's image spans (absolute positions)."""

    def step_mm(self, batch, embeds: dict, spans: dict) -> list[torch.Tensor]:
        """``batch``: ``(row, ids)``; ``embeds[row]``: ``{position: encoder row}`` of the
        sequence's image tokens; ``spans[row]``: its ``[start, end)`` image spans."""
        q_lens = [len(ids) for _, ids in batch]
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        positions, slots, rows_mask, rows_embeds = [], [], [], []
        for row, ids in batch:
            first = self.lens[row]
            positions.append(torch.arange(first, first + len(ids)))
            slots.append(self._grow(row, len(ids)))
            for p in range(first, first + len(ids)):
                image_row = embeds.get(row, {}).get(p)
                rows_mask.append(image_row is not None)
                if image_row is not None:
                    rows_embeds.append(image_row)
        kv_lens = [self.lens[row] for row, _ in batch]
        md = AttentionMetadata(
            num_seqs=len(batch),
            q_lens=q_lens,
            kv_lens=kv_lens,
            q_start_loc=torch.tensor(starts),
            q_lens_t=torch.tensor(q_lens),
            kv_lens_t=torch.tensor(kv_lens),
            req_pool_indices=torch.tensor([row for row, _ in batch]),
            req_to_token=self.req_pool.table,
            out_slots=torch.cat(slots),
            page_size=self.ps,
            is_decode=all(n == 1 for n in q_lens),
            q_starts=starts,
            req_rows=[row for row, _ in batch],
            bidirectional_spans=[list(spans.get(row, [])) for row, _ in batch]
            if any(spans.get(row) for row, _ in batch)
            else [],
        )
        md = self.attn.prepare_metadata(md)
        ids = torch.tensor([t for _, toks in batch for t in toks])
        mm = None
        if rows_embeds:
            mm = MultimodalForward(mask=torch.tensor(rows_mask), embeds=torch.stack(rows_embeds))
        with torch.inference_mode():
            hidden = self.model(ids, torch.cat(positions), ForwardContext(self.attn, md, mm=mm))
            logits = self.model.compute_logits(hidden)
        return [logits[starts[i] : starts[i + 1]] for i in range(len(batch))]


def _engine_view(model, ids: list[int], mm):
    """What the engine holds for a prompt: ids with pseudo-ids on image tokens, each image token's
    encoder row by position, the spans as ``[start, end)``."""
    encoded = model.encode_images(mm.items)
    ids = list(ids)
    rows, spans = {}, []
    for item, enc, (off, n) in zip(mm.items, encoded, mm.spans):
        assert enc.shape == (n, model.text["hidden_size"])
        for j in range(n):
            ids[off + j] = pseudo_id(item.digest)
            rows[off + j] = enc[j]
        spans.append((off, off + n))
    return ids, rows, spans


def _reference_logits(ref, ids: list[int], mm) -> torch.Tensor:
    """transformers over the whole sequence: soft tokens as ``image_token_index``, their pixels,
    ``token_type_ids`` marking them (the bidirectional blocks)."""
    types = torch.zeros(1, len(ids), dtype=torch.long)
    for off, n in mm.spans:
        types[0, off : off + n] = 1
    kw = {}
    if mm.items:
        kw = dict(pixel_values=torch.cat([it.pixel_values for it in mm.items]), token_type_ids=types)
    with torch.no_grad():
        return ref(input_ids=torch.tensor([ids]), **kw).logits[0]


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_vl_logits_match_transformers(vl, n_images):
    """Prefill in chunks that never split an image (two images: the first chunk ends between
    them), then four decode steps, batched with a text-only sequence; every logit equals
    transformers' over the whole sequence."""
    _, ref, model, tok, proc = vl
    ids, mm = _prompt(tok, proc, n_images)
    assert len(mm.spans) == n_images and mm.bidirectional
    assert all(ids[off : off + n] == [g3.IMAGE_SOFT] * n for off, n in mm.spans)
    assert len(ids) > g3.SLIDING_WINDOW
    pseudo, rows, spans = _engine_view(model, ids, mm)
    assert all(is_pseudo(pseudo[p]) for p in rows)

    runner = MMRunner(model, 4)
    a, b = runner.new_seq(), runner.new_seq()
    text_b = [(7 * i + 3) % 260 + 4 for i in range(13)]  # a text-only neighbour
    cut = mm.spans[1][0] - 2 if n_images == 2 else len(ids) // 2
    if n_images == 1:
        cut = mm.spans[0][0] + mm.spans[0][1] + 1  # the image whole in the first chunk
    la1, lb = runner.step_mm([(a, pseudo[:cut]), (b, text_b)], {a: rows}, {a: spans})
    (la2,) = runner.step_mm([(a, pseudo[cut:])], {a: rows}, {a: spans})
    ours = torch.cat([la1, la2])
    gen = [5, 77, 300, 12]
    full = _reference_logits(ref, ids + gen, mm)
    assert_close(ours, full[: len(ids)])
    with torch.no_grad():
        full_b = ref(torch.tensor([text_b + [9] * 4])).logits[0]
    assert_close(lb, full_b[: len(text_b)])
    for k, tok_id in enumerate(gen):
        la, lb = runner.step_mm([(a, [tok_id]), (b, [9])], {a: rows}, {a: spans})
        assert_close(la, full[len(ids) + k : len(ids) + k + 1])
        assert_close(lb, full_b[len(text_b) + k : len(text_b) + k + 1])


def test_vl_image_rows_attend_both_ways(vl):
    """The bidirectional spans matter: the causal mask alone gives other image-row logits."""
    _, ref, model, tok, proc = vl
    ids, mm = _prompt(tok, proc, 1)
    pseudo, rows, spans = _engine_view(model, ids, mm)
    runner = MMRunner(model, 4)
    (with_spans,) = runner.step_mm([(runner.new_seq(), pseudo)], {0: rows}, {0: spans})
    (causal,) = runner.step_mm([(runner.new_seq(), pseudo)], {1: rows}, {})
    off, n = mm.spans[0]
    assert not torch.allclose(with_spans[off : off + n - 1], causal[off : off + n - 1], atol=1e-3)


def test_vl_declares_its_features_and_encodes_in_one_batch(vl):
    _, _, model, tok, proc = vl
    assert BIDIRECTIONAL_SPANS in model.attention_features
    assert BIDIRECTIONAL_SPANS in TorchAttentionBackend.features
    items = [proc.preprocess(g3.random_image(s)) for s in range(3)]
    batched = model.encode_images(items)
    alone = model.encode_images(items[1:2])
    assert len(batched) == 3 and batched[0].shape == (g3.MM_TOKENS, g3.HIDDEN)
    assert_close(batched[1], alone[0], 1e-5)
    assert proc.preprocess(g3.random_image(0)).digest == items[0].digest != items[1].digest


TEXT, IMAGE = {"type": "text", "text": "first"}, {"type": "image"}


@pytest.mark.parametrize(
    "messages",
    [
        # images back to back ("\n\n" + "\n\n" between them: one token)
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": [TEXT, IMAGE, IMAGE, TEXT]}],
        # an image right after "user\n" ("\n" + "\n\n": one token), one at the end of the turn
        [{"role": "user", "content": [IMAGE, TEXT, IMAGE]}],
    ],
)
def test_processor_matches_transformers_processor(vl, messages):
    """expand() writes the ids transformers' Gemma3Processor writes for the chat-template text
    (its newlines merged with the template's), and preprocess() its pixels."""
    from transformers import Gemma3Processor

    path, _, _, tok, proc = vl
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images = [g3.random_image(s) for s in (1, 2)]
    hf = Gemma3Processor(g3.image_processor_class().from_pretrained(str(path)), tok, image_seq_length=g3.MM_TOKENS)
    theirs = hf(text=text, images=images, add_special_tokens=False, return_tensors="pt")
    items = [proc.preprocess(im) for im in images]
    ids, mm = proc.expand(tok(text, add_special_tokens=False)["input_ids"], items)
    assert ids == theirs["input_ids"][0].tolist()
    types = theirs["token_type_ids"][0].tolist()
    assert [i for i, t in enumerate(types) if t] == [off + j for off, n in mm.spans for j in range(n)]
    assert torch.equal(torch.cat([it.pixel_values for it in items]), theirs["pixel_values"].float())
    assert proc.placeholder_id == g3.BOI and proc.placeholder_text == "<start_of_image>"
    with pytest.raises(ValueError, match="placeholders"):
        proc.expand(tok(text, add_special_tokens=False)["input_ids"], items[:1])


# --- the torch backend's bidirectional spans ----------------------------------------------------


def _dense(q, k, v, qpos, spans, window, scale, kv_len):
    """Reference attention of rows at ``qpos`` over keys ``0 .. kv_len``: causal, or the same
    span both ways, and (with a window) no key at or before ``qpos - window``."""
    kpos = torch.arange(kv_len)
    seen = kpos[None, :] <= qpos[:, None]
    for s, e in spans:
        inside = (qpos[:, None] >= s) & (qpos[:, None] < e) & (kpos[None, :] >= s) & (kpos[None, :] < e)
        seen |= inside
    if window:
        seen &= kpos[None, :] > qpos[:, None] - window
    g = q.shape[1] // k.shape[1]
    kk, vv = k[:kv_len].repeat_interleave(g, 1), v[:kv_len].repeat_interleave(g, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
    scores = scores.masked_fill(~seen[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("window", [None, 3, 6])
def test_torch_backend_bidirectional_spans_match_a_dense_mask(native, window):
    """Sequence A: 6 tokens cached, then 18 new rows holding two spans (one of 4, one of 5 rows:
    longer than a window of 3), beside sequence B's decode row; then A decodes one row."""
    torch.manual_seed(0)
    h, hkv, d, n = 4, 2, 8, 40
    pool = KVCachePool(
        num_layers=1, num_pages=n + 2, page_size=2, num_kv_heads=hkv, head_dim=d, dtype=torch.float32, device="cpu"
    )
    req = ReqToTokenPool(4, 64, torch.device("cpu"))
    attn = TorchAttentionBackend(num_heads=h, num_kv_heads=hkv, head_dim=d, pool=pool, device=torch.device("cpu"))
    attn._native = native and attn._native_rows()
    if native and not attn._native:
        pytest.skip("the C attention kernel does not build here")
    q_all, k_all, v_all = (torch.randn(2, n, x, d) for x in (h, hkv, hkv))
    lens = [0, 0]
    req.table[0, :n] = pool.page_slots(pool.allocate(n // 2))
    req.table[1, :n] = pool.page_slots(pool.allocate(n // 2))
    spans_a = [(8, 12), (15, 20)]

    def forward(batch, spans):
        q_lens = [m for _, m in batch]
        starts = [0]
        for m in q_lens:
            starts.append(starts[-1] + m)
        qs, ks, vs, slots = [], [], [], []
        for s, m in batch:
            qs.append(q_all[s, lens[s] : lens[s] + m])
            ks.append(k_all[s, lens[s] : lens[s] + m])
            vs.append(v_all[s, lens[s] : lens[s] + m])
            slots.append(req.table[s, lens[s] : lens[s] + m])
            lens[s] += m
        kv_lens = [lens[s] for s, _ in batch]
        md = AttentionMetadata(
            num_seqs=len(batch),
            q_lens=q_lens,
            kv_lens=kv_lens,
            q_start_loc=torch.tensor(starts),
            q_lens_t=torch.tensor(q_lens),
            kv_lens_t=torch.tensor(kv_lens),
            req_pool_indices=torch.tensor([s for s, _ in batch]),
            req_to_token=req.table,
            out_slots=torch.cat(slots),
            page_size=2,
            is_decode=all(m == 1 for m in q_lens),
            q_starts=starts,
            req_rows=[s for s, _ in batch],
            bidirectional_spans=spans,
        )
        md = attn.prepare_metadata(md)
        out = attn.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), 0, md, sliding_window=window)
        return [out[starts[i] : starts[i + 1]] for i in range(len(batch))]

    forward([(0, 6), (1, 9)], [])  # A's cached prefix, B's prompt
    out_a, out_b = forward([(0, 18), (1, 1)], [spans_a, []])
    scale = d**-0.5
    assert_close(out_a, _dense(q_all[0, 6:24], k_all[0], v_all[0], torch.arange(6, 24), spans_a, window, scale, 24))
    assert_close(out_b, _dense(q_all[1, 9:10], k_all[1], v_all[1], torch.arange(9, 10), [], window, scale, 10))
    (dec_a,) = forward([(0, 1)], [spans_a])  # a decode row past the spans: causal
    assert_close(dec_a, _dense(q_all[0, 24:25], k_all[0], v_all[0], torch.arange(24, 25), spans_a, window, scale, 25))


# --- the published checkpoints' layout ----------------------------------------------------------


def test_text_model_reads_published_config_fields(tmp_path):
    """The published configs spell rope as ``rope_theta`` + ``rope_scaling`` (global layers) and
    ``rope_local_base_freq`` (sliding ones), and the layer pattern as ``sliding_window_pattern``."""
    import json

    legacy = dict(
        rope_theta=50_000.0,
        rope_local_base_freq=500.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        sliding_window_pattern=2,
    )
    ref = g3.save_tiny_gemma3_text(tmp_path, rope_parameters=None, layer_types=None, **legacy)
    assert ref.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_parameters", "layer_types"):
        config.pop(key)
    (tmp_path / "config.json").write_text(json.dumps({**config, **legacy}))
    model = load_ours(tmp_path)
    assert [layer.self_attn.sliding_window for layer in model.layers] == [8, None, 8]
    ids = [(29 * i + 7) % g3.VOCAB for i in range(24)]
    runner = PagedRunner(model, 4)
    (ours,) = runner.step([(runner.new_seq(), ids)])
    with torch.no_grad():
        assert_close(ours, ref(torch.tensor([ids])).logits[0])


def test_vl_loads_published_weight_names(vl):
    """google/gemma-3-*-it name their tensors ``language_model.model.*``,
    ``vision_tower.vision_model.*`` and ``multi_modal_projector.*``."""
    from llmkit.core.model.loader.source import iter_safetensors

    path, _, model, _, proc = vl
    other = type(model)(model.config).eval()

    def published(name: str) -> str:
        name = name.removeprefix("model.")
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            return name.replace("vision_tower.", "vision_tower.vision_model.", 1)
        return name

    other.load_weights((published(n), t) for n, t in iter_safetensors(path))
    item = proc.preprocess(g3.random_image(3))
    assert torch.equal(other.encode_images([item])[0], model.encode_images([item])[0])


def test_vl_runs_in_bfloat16(vl):
    path, _, model, tok, proc = vl
    ours = load_ours(path, dtype=torch.bfloat16)
    ids, mm = _prompt(tok, proc, 1)
    pseudo, rows, spans = _engine_view(ours, ids, mm)
    assert next(iter(rows.values())).dtype == torch.bfloat16
    runner = MMRunner(ours, 4, kv_dtype=torch.bfloat16)
    (logits,) = runner.step_mm([(runner.new_seq(), pseudo)], {0: rows}, {0: spans})
    pseudo32, rows32, _ = _engine_view(model, ids, mm)
    runner32 = MMRunner(model, 4)
    (logits32,) = runner32.step_mm([(runner32.new_seq(), pseudo32)], {0: rows32}, {0: spans})
    assert torch.isfinite(logits).all()
    assert (logits - logits32).abs().max() < 0.1 * logits32.abs().max()


def _tp_rank(rank: int, size: int, init: str, model_dir: str, out: str, ids: list[int]) -> None:
    import sys
    from pathlib import Path

    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
    from llmkit.core.engine.builder import build_model
    from llmkit.core.model import quantize
    from llmkit.core.model.loader.source import iter_safetensors, load_config
    from llmkit.core.model.parallel import TPGroup
    from llmkit.core.plugins import registry

    from paged_runner import PagedRunner

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        torch.set_num_threads(1)
        config = load_config(Path(model_dir))
        tp = TPGroup(rank=rank, size=size, group=dist.group.WORLD)
        model = build_model(
            registry().model(config["architectures"][0]), config, torch.device("cpu"), torch.float32, tp
        )
        model.load_weights(iter_safetensors(Path(model_dir)))
        quantize.finalize_weights(model)
        runner = PagedRunner(model, 4)
        s = runner.new_seq()
        (prefill,) = runner.step([(s, ids[:-2])])
        decode = [runner.step([(s, [t])])[0] for t in ids[-2:]]
        torch.save({"logits": torch.cat([prefill, *decode]), "heads": model.local_heads}, out)
        dist.barrier()  # leave together: a rank torn down while its peer still talks can abort
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_text_model_two_ranks_match_transformers(tmp_path):
    """Gemma3ForCausalLM sharded over two gloo ranks (heads, channels, vocabulary rows)."""
    import torch.multiprocessing as mp

    model_dir = tmp_path / "model"
    ref = g3.save_tiny_gemma3_text(model_dir)
    ids = [(37 * i + 11) % g3.VOCAB for i in range(20)]
    with torch.no_grad():
        full = ref(torch.tensor([ids])).logits[0]
    init = f"file://{tmp_path / 'rendezvous'}"
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(2)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_tp_rank, args=(r, 2, init, str(model_dir), outs[r], ids)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    for out in outs:
        got = torch.load(out)
        assert got["heads"] == 2
        assert_close(got["logits"], full)


def test_text_model_served_by_the_engine_matches_generate(tmp_path):
    """The real engine (chunked prefill of 16, radix cache) on the tiny text checkpoint: greedy
    tokens equal transformers' generate, the second prompt reusing the first one's pages."""
    from model_utils import assert_greedy_matches_generate

    ref = g3.save_tiny_gemma3_text(tmp_path)
    first = [(37 * i + 11) % g3.VOCAB for i in range(40)]
    cached = assert_greedy_matches_generate(ref, tmp_path, [first, first[:32] + [5, 6, 7]], n=12)
    assert cached[1] == 32
