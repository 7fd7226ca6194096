"""The ``torch`` attention backend: the CPU reference every other backend is tested against.

Every row's result is a function of that row's query and its own keys only, bit for bit: it does
not depend on which other sequences share the batch, on how a prompt was split between the prefix
cache and this step (a cache hit recomputes its last prompt token alone), or on padding. Serving at
bf16-activation precision (the int4 kernels) turns any ulp of difference into a different token
now and then, so without this, streaming would not equal non-streaming and a seed would not repeat
once a prompt hits the prefix cache. SDPA's fused CPU kernel does not give it (its row results
depend on the query count and the key-block split), so attention is three batched GEMMs and a
softmax here, laid out so the results hold still (measured on this CPU's BLAS, and kept by
``tests/attention/test_attention_invariance.py``):
- a GEMM whose row count is a multiple of :data:`_ROWS` takes the same kernel whatever its size,
  and each output row depends only on its inputs' rows (1-3 rows take another kernel, and so do
  5-7 and 9-11 when the batch has one matrix), provided its alpha is 1 (the softmax scale goes
  into the queries: see :meth:`TorchAttentionBackend._prompt`) and, for wide heads, it has at
  least :data:`_MIN_PROMPT_ROWS` rows (a prompt chunk's are padded to that);
- appending keys a row does not see (a ``-inf`` score) leaves its softmax as it was;
- the probability-times-value sum does depend on the GEMM's inner size (the BLAS splits it
  differently), so keys are padded to whole blocks of :data:`_KEY_BLOCK` and the blocks' products
  are added in order; a block past a row's last key adds exact zeros.

Where the C kernel of ``cpu_attention.c`` builds, every row (prompt and decode alike) is
one task of it: it reads the pool in place, and a row's result is a function of its query and its
own keys by construction, so a prompt row equals the decode row at the same position (K/V
recomputed after a preemption are what decoding wrote) and a decode batch costs ~10x less than the
padded GEMMs at 64 sequences. Without it (the fallback, below): prompt rows (prefill, or an extend
past a cached prefix) run per sequence in chunks of query positions, and decode rows run as one
padded batch, in pure decode steps and in mixed ones alike. A KV head's query group stacks into the GEMM's rows, so GQA never copies K/V
per query head. Sliding windows are part of the mask; a sink is one extra score in front of the
keys that takes its share of the softmax and has no value.

Bidirectional spans (``metadata.bidirectional_spans``, Gemma 3's image tokens): every row is first
computed causally as above, then the rows inside a span are computed again over their keys up to
the span's end (the window, if any, still counts back from the row's own position) and replace
the causal ones. A text row never changes, so its numbers are those of a forward without spans.
"""

from __future__ import annotations

import dataclasses

import torch

from llmkit.core.kvcache.kv_pool import gather_kv, store_kv
from llmkit.core.model.attention import (
    BIDIRECTIONAL_SPANS,
    LATENT_KV,
    SINKS,
    SLIDING_WINDOW,
    TOKEN_SLOTS,
    AttentionBackend,
    AttentionMetadata,
)
from llmkit.plugins.attention import cpu_attention
from llmkit.plugins.attention.torch_attention_ops import (
    _CHUNK,
    _MIN_PROMPT_ROWS,
    _blocks,
    _head_rows,
    _padded_slots,
    _rows,
    _same_tensor,
    _softmax,
    _table_rows,
    _weighted_values,
)


class TorchAttentionBackend(AttentionBackend):
    features = frozenset({SLIDING_WINDOW, SINKS, LATENT_KV, BIDIRECTIONAL_SPANS, TOKEN_SLOTS})

    @classmethod
    def kv_cache_dtype_support(cls, dtype: torch.dtype, device: torch.device) -> str | None:
        return None  # any float pool dtype, fp8 included: converted on write and on read

    def prepare_metadata(self, md: AttentionMetadata) -> AttentionMetadata:
        starts = md.q_starts or md.q_start_loc.tolist()
        rows = md.req_rows or md.req_pool_indices.tolist()
        if md.bidirectional_spans:
            md.extra["torch_spans"] = self._span_metadata(md, starts, rows)
            if not md.extra["torch_spans"]:  # no span row among this forward's: a causal forward
                md.bidirectional_spans = []
        if self._native_rows():
            md.extra["torch_native"] = self._native_metadata(md, starts, rows, self.device)
            return md
        decoding = md.decoding or [n == 1 for n in md.q_lens]
        dec = [i for i in range(md.num_seqs) if decoding[i]]
        if dec:
            lens = [md.kv_lens[i] for i in dec]
            max_len = _blocks(max(lens))
            lens_t = torch.tensor(lens, device=self.device)
            table = _table_rows(md.req_to_token, [rows[i] for i in dec], max_len, self.device)
            pos = torch.arange(max_len, device=self.device)
            valid = pos[None, :] < lens_t[:, None]
            # padding reads slot 0, which is never handed out: finite, and masked
            slots = torch.where(valid, table, torch.zeros_like(table))
            md.extra["torch_decode"] = {
                "rows": _head_rows(slots, self.num_kv_heads),
                "valid": valid,
                "lens": lens_t,
                # the rows of q (and of the output) the decode rows sit at; None: all of them, in order
                "q_rows": None
                if len(dec) == md.num_seqs
                else torch.tensor([starts[i] for i in dec], device=self.device),
            }
        md.extra["torch_prompts"] = [
            (
                starts[i],
                starts[i] + md.q_lens[i],
                _head_rows(_padded_slots(md.req_to_token, rows[i], md.kv_lens[i]), self.num_kv_heads),
                md.kv_lens[i],
            )
            for i in range(md.num_seqs)
            if not decoding[i]
        ]
        return md

    def _native_rows(self) -> bool:
        """Every row goes to the C kernel (reads the pool in place) where it builds; else padded GEMMs."""
        if not hasattr(self, "_native"):
            self._native = cpu_attention.available(self.pool.dtype, torch.device(self.device))
        return self._native

    @staticmethod
    def _native_metadata(md: AttentionMetadata, starts: list[int], rows: list[int], device) -> dict:
        """Per query row: its sequence's slot-table row and how many keys it sees (its position + 1).
        A prompt row and the decode row at the same position are the same computation, so K/V
        recomputed after a preemption, or read from the prefix cache, are what decoding wrote."""
        if md.q_lens.count(1) == len(md.q_lens):  # one query row a sequence
            rows_t = _same_tensor(md.req_pool_indices, rows, device)
            return {"table": md.req_to_token, "rows": rows_t, "lens": _same_tensor(md.kv_lens_t, md.kv_lens, device)}
        row_t = torch.zeros(sum(md.q_lens), dtype=torch.int64, device=device)
        len_t = torch.zeros_like(row_t)
        for start, n, kv, row in zip(starts, md.q_lens, md.kv_lens, rows):
            row_t[start : start + n] = row
            torch.arange(kv - n + 1, kv + 1, out=len_t[start : start + n], device=device)
        return {"table": md.req_to_token, "rows": row_t, "lens": len_t}

    def _forward_spans(self, q, k, v, layer_id, md, sliding_window, sinks):
        """:meth:`forward` of a batch with bidirectional spans: causal rows, then the span rows again."""
        causal = dataclasses.replace(md, bidirectional_spans=[])  # shares ``extra``
        out = self.forward(q, k, v, layer_id, causal, sliding_window=sliding_window, sinks=sinks)
        spans = md.extra.get("torch_spans")
        if spans:
            self._span_rows(out, q, layer_id, spans, sliding_window, sinks, latent=v is None)
        return out

    def _span_metadata(self, md: AttentionMetadata, starts: list[int], rows: list[int]) -> list:
        """Per span with new rows in this forward: the rows of ``q`` (``r0 .. r1``), their
        positions, and the pool rows (:func:`_head_rows`) of the keys ``0 .. span end`` they see."""
        out = []
        for i, spans in enumerate(md.bidirectional_spans[: md.num_seqs]):
            kv_len, first = md.kv_lens[i], md.kv_lens[i] - md.q_lens[i]
            for s, e in spans:
                p0, p1, end = max(s, first), min(e, kv_len), min(e, kv_len)
                if p0 >= p1:
                    continue  # the span's rows were computed in an earlier forward
                slots = md.req_to_token[rows[i], :end]
                pos = torch.arange(p0, p1, device=self.device)
                r0 = starts[i] + p0 - first
                out.append((r0, r0 + p1 - p0, pos, _head_rows(slots, self.num_kv_heads), end))
        return out

    def _span_rows(self, out, q, layer_id, spans, window, sinks, latent):
        """Recompute the rows of ``out`` inside bidirectional spans, in place: each sees every key
        up to its span's end (and none older than its window)."""
        kbuf = self.pool.k_buffers[layer_id]
        vbuf = None if latent else self.pool.v_buffers[layer_id]
        hkv = self.num_kv_heads
        g = self.num_heads // hkv
        for r0, r1, pos, head_rows, n in spans:
            ks, vs = self._keys_values(kbuf, vbuf, head_rows)
            ks, vs = ks.view(hkv, n, -1), vs.view(hkv, n, -1)
            m = r1 - r0
            qg = (q[r0:r1].float() * self.scale).reshape(m, hkv, g, -1).permute(1, 2, 0, 3).reshape(hkv, g * m, -1)
            bias = torch.zeros(m, n, device=q.device)
            if window:
                kpos = torch.arange(n, device=q.device)
                bias.masked_fill_(kpos[None, :] <= pos[:, None] - window, float("-inf"))
            scores = torch.baddbmm(bias.repeat(g, 1).unsqueeze(0), qg, ks.transpose(1, 2))
            row_sinks = None
            if sinks is not None:
                row_sinks = sinks.float().view(hkv, g).repeat_interleave(m, dim=1).view(hkv, g * m, 1)
            o = torch.bmm(_softmax(scores, row_sinks), vs)  # [Hkv, G*m, Dv]
            out[r0:r1] = o.view(hkv, g, m, -1).permute(2, 0, 1, 3).reshape(m, self.num_heads, -1).to(out.dtype)

    def forward(self, q, k, v, layer_id, md, *, sliding_window=None, sinks=None):
        if md.bidirectional_spans:
            return self._forward_spans(q, k, v, layer_id, md, sliding_window, sinks)
        # The new tokens' K/V are read back from the pool like the cached ones (in its dtype, under
        # --kv-cache-dtype), so a prompt served from the prefix cache sees exactly these values.
        kbuf = self.pool.k_buffers[layer_id]
        vbuf = None if v is None else self.pool.v_buffers[layer_id]  # None: latent KV (values = keys' first channels)
        dtype = q.dtype
        native = md.extra.get("torch_native")
        slots = md.out_slots
        if native is not None and cpu_attention.stores(kbuf.dtype, k, v, slots):
            # one C call writes the new K/V and attends (two index_copy_ dispatches fewer a layer)
            return self._native_attention(q.float(), kbuf, vbuf, native, sliding_window, sinks, (k, v, slots)).to(dtype)
        store_kv(kbuf, slots, k)
        if v is not None:
            store_kv(vbuf, slots, v)
        q = q.float()  # scores and softmax in fp32 whatever the model dtype
        if native is not None:
            return self._native_attention(q, kbuf, vbuf, native, sliding_window, sinks).to(dtype)
        sinks = None if sinks is None else sinks.float().view(self.num_kv_heads, -1)
        dec, prompts = md.extra.get("torch_decode"), md.extra["torch_prompts"]
        if dec is not None and dec["q_rows"] is None:
            return self._decode(q, kbuf, vbuf, dec, sliding_window, sinks, md.extra).to(dtype)
        out = q.new_empty(q.shape[0], self.num_heads, self.v_head_dim)
        if dec is not None:
            o = self._decode(q.index_select(0, dec["q_rows"]), kbuf, vbuf, dec, sliding_window, sinks, md.extra)
            out.index_copy_(0, dec["q_rows"], o)
        for i, (start, end, slots, kv_len) in enumerate(prompts):
            out[start:end] = self._prompt(i, q[start:end], kbuf, vbuf, slots, kv_len, sliding_window, sinks, md.extra)
        return out.to(dtype)

    def _rope_native(self, rope, md) -> dict | None:
        """This forward's C-kernel metadata where the kernel can also apply ``rope`` (fp32 tables
        of the head size, values as wide as the keys); else None. forward_qkv's and
        native_attend's shared conditions."""
        native = md.extra.get("torch_native")
        cos2 = rope[0]
        d = self.head_dim
        if native is None or cos2.dtype != torch.float32 or cos2.shape[-1] != d or self.v_head_dim != d:
            return None
        return native

    def forward_qkv(self, qkv, rope, layer_id, md):
        if md.bidirectional_spans:
            return None  # forward() recomputes the span rows
        native = self._rope_native(rope, md)
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if native is None or qkv.stride(1) != 1 or qkv.shape[1] != (h + 2 * hkv) * d:
            return None
        t = qkv.shape[0]
        q = qkv[:, : h * d].view(t, h, d)
        k = qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)
        v = qkv[:, (h + hkv) * d :].view(t, hkv, d)
        kbuf, vbuf = self.pool.k_buffers[layer_id], self.pool.v_buffers[layer_id]
        if not cpu_attention.stores(kbuf.dtype, k, v, md.out_slots):  # (checks the fp32 dtype too)
            return None
        cos2, sin2 = rope
        tables = (cos2.reshape(t, d), sin2.reshape(t, d))
        return self._native_attention(q, kbuf, vbuf, native, None, None, (k, v, md.out_slots), tables)

    def native_attend(self, rope, md):
        if md.bidirectional_spans:
            return None
        native = self._rope_native(rope, md)
        pool = self.pool
        if native is None or not pool.v_buffers or not cpu_attention.stores(pool.dtype, None, None, md.out_slots):
            return None
        if getattr(self, "_pool_ptrs", None) is None:  # the buffers never move: their addresses once
            self._pool_ptrs = (cpu_attention.layer_ptrs(pool.k_buffers), cpu_attention.layer_ptrs(pool.v_buffers))
        cos2, sin2 = rope
        t, d = cos2.shape[0], self.head_dim
        return cpu_attention.attend_step(
            pool,
            self._pool_ptrs,
            native,
            md.out_slots.contiguous(),
            (cos2.reshape(t, d).contiguous(), sin2.reshape(t, d).contiguous()),
            self.num_heads,
            self.scale,
        )

    def _native_attention(self, q, kbuf, vbuf, native, window, sinks, new_kv=None, rope=None):
        """Every row of ``q [T, H, D]`` through the C kernel -> ``[T, H, Dv]`` (``new_kv``: the
        ``(k, v, slots)`` it writes to the pool first)."""
        n = native["rows"].shape[0]
        out = cpu_attention.paged_attention(
            q[:n],
            kbuf,
            vbuf,
            native["table"],
            native["rows"],
            native["lens"],
            scale=self.scale,
            window=window,
            sinks=None if sinks is None else sinks.float().reshape(-1).contiguous(),
            v_head_dim=self.v_head_dim,
            new_kv=None if new_kv is None else (new_kv[0], new_kv[1], new_kv[2].contiguous()),
            rope=rope,
        )
        return out if n == q.shape[0] else torch.cat([out, out.new_zeros(q.shape[0] - n, *out.shape[1:])])

    def _keys_values(self, kbuf, vbuf, rows):
        """Keys ``[Hkv * n, D]`` and values ``[Hkv * n, Dv]`` at pool ``rows`` (see :func:`_head_rows`), in fp32."""
        ks = gather_kv(kbuf.view(-1, kbuf.shape[-1]), rows, torch.float32)
        vs = (
            ks[..., : self.v_head_dim]
            if vbuf is None
            else gather_kv(vbuf.view(-1, vbuf.shape[-1]), rows, torch.float32)
        )
        return ks, vs

    def _decode_bias(self, dec, window, md_extra):
        """The decode rows' additive mask ``[B * Hkv, 1, n]`` (padding, and keys older than the
        window), built once per forward and window."""
        key = ("torch_decode_bias", window)
        if key not in md_extra:
            hidden = ~dec["valid"]
            if window:
                pos = torch.arange(hidden.shape[1], device=self.device)
                hidden = hidden | (pos[None, :] <= dec["lens"][:, None] - 1 - window)
            bias = torch.zeros(hidden.shape, device=self.device).masked_fill_(hidden, float("-inf"))
            md_extra[key] = bias.repeat_interleave(self.num_kv_heads, dim=0).unsqueeze(1)
        return md_extra[key]

    def _prompt_bias(self, seq, first, c0, c1, n, rows, window, md_extra):
        """The additive causal (and window) mask ``[1, rows, n]`` of one prompt chunk, rows in
        (group member, position) order, zero for padding rows; once per forward and window."""
        key = ("torch_prompt_bias", seq, c0, window)
        if key not in md_extra:
            g = self.num_heads // self.num_kv_heads
            qpos = torch.arange(first + c0, first + c1, device=self.device)[:, None]
            kpos = torch.arange(n, device=self.device)[None, :]
            hidden = kpos > qpos
            if window:
                hidden |= kpos <= qpos - window
            bias = torch.zeros(rows, n, device=self.device)
            bias[: g * (c1 - c0)].view(g, c1 - c0, n).masked_fill_(hidden, float("-inf"))
            md_extra[key] = bias.unsqueeze(0)
        return md_extra[key]

    def _decode(self, q, kbuf, vbuf, dec, window, sinks, md_extra):
        """One padded batch of decode rows: ``q [B, H, D]`` -> ``[B, H, Dv]``."""
        b, hkv = q.shape[0], self.num_kv_heads
        g = self.num_heads // hkv
        rows = _rows(g)
        ks, vs = self._keys_values(kbuf, vbuf, dec["rows"])
        n = ks.shape[0] // (b * hkv)
        qg = q.reshape(b * hkv, g, -1) * self.scale  # each KV head's query group as GEMM rows, zero rows below
        if rows > g:
            qg = torch.cat([qg, qg.new_zeros(b * hkv, rows - g, qg.shape[-1])], dim=1)
        bias = self._decode_bias(dec, window, md_extra)
        # (scale * q) k^T + mask (0 or -inf) in one GEMM (see _prompt: alpha stays 1)
        scores = torch.baddbmm(bias, qg, ks.view(b * hkv, n, -1).transpose(1, 2))
        scores = scores.view(b, hkv, rows, n)
        if sinks is not None:
            sinks = torch.cat([sinks, sinks.new_zeros(hkv, rows - g)], dim=1) if rows > g else sinks
            sinks = sinks.view(1, hkv, rows, 1)
        probs = _softmax(scores, sinks).view(b * hkv, rows, n)
        out = _weighted_values(probs, vs.view(b * hkv, n, -1)).view(b, hkv, rows, -1)[:, :, :g]
        return out.reshape(b, self.num_heads, self.v_head_dim)

    def _prompt(self, seq, q, kbuf, vbuf, head_rows, kv_len, window, sinks, md_extra):
        """One sequence's new prompt rows ``q [m, H, D]`` (positions ``kv_len - m ...``) -> ``[m, H, Dv]``."""
        m, hkv = q.shape[0], self.num_kv_heads
        g = self.num_heads // hkv
        ks, vs = self._keys_values(kbuf, vbuf, head_rows)
        ks, vs = ks.view(hkv, -1, ks.shape[-1]), vs.view(hkv, -1, vs.shape[-1])
        out = q.new_empty(m, self.num_heads, self.v_head_dim)
        first = kv_len - m
        for c0 in range(0, m, _CHUNK):
            c1 = min(m, c0 + _CHUNK)
            mc, n = c1 - c0, _blocks(first + c1)  # keys past the chunk's last position are never seen
            # [Hkv, G * mc, D]: rows (g, position), times the scale; a short chunk gets zero query
            # rows below it. The scale goes into the queries, not the GEMM's alpha: with alpha != 1
            # and more than one thread, MKL computes a one-matrix GEMM (an MLA or MQA layer's one KV
            # head) of few rows differently from a taller one (16-56 rows at 2 threads on AVX-512/AMX
            # Xeons, more at more threads), so a row would depend on its chunk's length.
            rows = max(_rows(g * mc), _MIN_PROMPT_ROWS)
            qg = (q.new_zeros if rows > g * mc else q.new_empty)(hkv, rows, q.shape[-1])
            rows_q = q[c0:c1].reshape(mc, hkv, g, -1).permute(1, 2, 0, 3)
            torch.mul(rows_q, self.scale, out=qg[:, : g * mc].view(hkv, g, mc, -1))
            bias = self._prompt_bias(seq, first, c0, c1, n, rows, window, md_extra)
            scores = torch.baddbmm(bias, qg, ks[:, :n].transpose(1, 2))
            row_sinks = None
            if sinks is not None:
                row_sinks = sinks.repeat_interleave(mc, dim=1)
                if rows > g * mc:
                    row_sinks = torch.cat([row_sinks, row_sinks.new_zeros(hkv, rows - g * mc)], dim=1)
                row_sinks = row_sinks.view(hkv, rows, 1)
            probs = _softmax(scores, row_sinks)
            o = _weighted_values(probs, vs[:, :n])[:, : g * mc]  # [Hkv, G*mc, Dv]
            out[c0:c1] = o.view(hkv, g, mc, -1).permute(2, 0, 1, 3).reshape(mc, self.num_heads, -1)
        return out
