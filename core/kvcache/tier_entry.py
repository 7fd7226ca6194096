"""One storage-tier entry: a block's K/V for every layer, with its own key and a checksum.

Layout: ``MAGIC | key (32 bytes) | payload length (8) | crc32 of the payload (4) | payload``. The
payload is each layer's K then V rows for the block's tokens, raw bytes in the pool's dtype, so a
loaded page is bit-for-bit the page that was computed. :func:`decode` returns the reason an entry
is unusable instead of raising: a corrupt, truncated or foreign entry is a miss, never an error.
"""

from __future__ import annotations

import struct
import zlib

import torch

MAGIC = b"LKKV\x01\x00"
_HEADER = struct.Struct("<32sQI")
HEADER_BYTES = len(MAGIC) + _HEADER.size


def encode(key: bytes, tensors: list[torch.Tensor]) -> bytes:
    """The entry for ``tensors`` (one block's rows of each K and V buffer, in layer order)."""
    payload = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]).numpy().tobytes()
    return MAGIC + _HEADER.pack(key, len(payload), zlib.crc32(payload)) + payload


def decode(key: bytes, blob: bytes, like: list[torch.Tensor]) -> tuple[list[torch.Tensor] | None, str]:
    """``(tensors, "")`` shaped as ``like`` (one block's rows of each buffer: dtype and shape), or
    ``(None, why)``: ``truncated``, ``corrupt`` (bad magic or checksum), ``foreign`` (stored under
    a key not its own) or ``layout`` (another model's shapes)."""
    if len(blob) < HEADER_BYTES:
        return None, "truncated"
    if blob[: len(MAGIC)] != MAGIC:
        return None, "corrupt"
    own, length, crc = _HEADER.unpack_from(blob, len(MAGIC))
    if own != key:
        return None, "foreign"
    payload = memoryview(blob)[HEADER_BYTES:]
    if len(payload) < length:
        return None, "truncated"
    if len(payload) > length or zlib.crc32(payload) != crc:
        return None, "corrupt"
    sizes = [t.numel() * t.element_size() for t in like]
    if sum(sizes) != length:
        return None, "layout"
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    out, off = [], 0
    for t, n in zip(like, sizes):
        out.append(flat[off : off + n].view(t.dtype).view(t.shape))
        off += n
    return out, ""
