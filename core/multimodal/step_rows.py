"""The engine's side of images: which rows of a forward are image tokens, their M-RoPE positions,
and the encoder's output for each image, computed once and kept by content hash."""

from __future__ import annotations

from collections import OrderedDict

import torch

from llmkit.core.multimodal.forward import MultimodalForward


def plan_images(segments, seg_rows: list[int], positions: list[int]):
    """For one step's segments (each starting at row ``seg_rows[i]`` of the forward): the image
    rows as ``(first row, item, first encoder row, end encoder row)``, the (t, h, w) rotary
    positions of every row when some segment needs M-RoPE (else None), and per sequence its
    bidirectional spans (empty lists: none)."""
    images, rope, spans, any_span = [], None, [], False
    for s, row0 in zip(segments, seg_rows):
        mm = s.req.mm
        seq_spans: list[tuple[int, int]] = []
        spans.append(seq_spans)
        if mm is None:
            continue
        end = s.start + s.length - len(s.draft)
        for item, (off, n) in zip(mm.items, mm.spans):
            a, b = max(off, s.start), min(off + n, end)
            if a < b:
                images.append((row0 + a - s.start, item, a - off, b - off))
                if mm.bidirectional:
                    seq_spans.append((off, off + n))
                    any_span = True
        if mm.rope_positions is not None:
            if rope is None:
                rope = [list(positions), list(positions), list(positions)]
            prompt_len, delta = len(mm.rope_positions[0]), mm.rope_delta
            for r in range(row0, row0 + s.length):
                p = positions[r]
                for axis in range(3):
                    rope[axis][r] = mm.rope_positions[axis][p] if p < prompt_len else p + delta
    return images, rope, spans if any_span else []


class EncoderCache:
    """Each image's encoder rows by content hash, least recently used dropped past the budget:
    a chunked prefill reads the rows of one image over several steps, and the same image sent
    again (a multi-turn chat re-sends every earlier image) is not encoded again."""

    def __init__(self, model, max_bytes: int = 512 << 20) -> None:
        self.model = model
        self.max_bytes = max_bytes
        self._rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.encoded = 0  # images run through the encoder (a test reads it)

    def rows(self, items: list) -> dict[str, torch.Tensor]:
        missing, seen = [], set()
        for item in items:
            if item.digest not in self._rows and item.digest not in seen:
                missing.append(item)
                seen.add(item.digest)
        out = {}
        if missing:
            for item, rows in zip(missing, self.model.encode_images(missing)):
                if rows.shape[0] != item.num_tokens:
                    raise RuntimeError(
                        f"the encoder gave {rows.shape[0]} rows for an image of {item.num_tokens} tokens"
                    )
                out[item.digest] = rows
            self.encoded += len(missing)
        for item in items:
            if item.digest not in out:
                out[item.digest] = self._rows[item.digest]
                self._rows.move_to_end(item.digest)
        for digest in seen:
            self._put(digest, out[digest])
        return out

    def _put(self, digest: str, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        self._rows[digest] = rows
        self._bytes += size
        while self._bytes > self.max_bytes and len(self._rows) > 1:
            _, old = self._rows.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()

    def forward_inputs(self, images, rope, num_rows: int, device) -> MultimodalForward:
        """``ctx.mm`` for a forward of ``num_rows`` rows from :func:`plan_images`' output."""
        mask = torch.zeros(num_rows, dtype=torch.bool)
        parts = []
        if images:
            rows = self.rows([it for _, it, _, _ in images])
            for row0, item, a, b in images:
                mask[row0 : row0 + b - a] = True
                parts.append(rows[item.digest][a:b])
        # in the encoder's dtype (the model's); an empty [0] tensor when only M-RoPE is needed
        embeds = torch.cat(parts).to(device) if parts else torch.empty(0, device=device)
        rope_t = torch.tensor(rope, dtype=torch.int64, device=device) if rope is not None else None
        return MultimodalForward(mask=mask.to(device), embeds=embeds, rope_positions=rope_t)


def whole_images(req, start: int, length: int) -> int:
    """``length`` shortened (or, for a chunk that starts an image, lengthened) so that a prefill
    chunk from ``start`` never ends inside an image whose tokens attend to each other both ways:
    all of its keys must be in the forward that computes any of its queries."""
    mm = req.mm
    if mm is None or not mm.bidirectional:
        return length
    end = start + length
    for off, n in mm.spans:
        if off < end < off + n:
            return off - start if off > start else off + n - start
    return length
