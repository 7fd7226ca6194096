"""Content addresses of the storage tier's entries.

An entry holds the K/V of one block of tokens. Its key is a hash chain (SGLang's HiCache keys
pages the same way): ``key[i] = sha256(key[i-1] || tokens of block i)``, and ``key[-1]`` is a
seed hashed from everything else the K/V depends on: the model and a fingerprint of its weights,
the K/V dtype and layout, the block size, the tensor-parallel layout and the namespace (adapter,
owner, ``cache_salt``). Two requests share an entry only if they would compute the same K/V, so a
wrong hit cannot happen by construction; a stale or foreign entry is simply never looked up.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Sequence

# Bytes of a weight file hashed for its fingerprint: its size, its head (the safetensors / GGUF
# header names and shapes every tensor) and evenly spaced samples, so a fine-tuned checkpoint of
# the same shapes differs. Hashing every byte would cost seconds a GB at each start.
_HEAD_BYTES = 1 << 20
_SAMPLES = 64
_SAMPLE_BYTES = 1 << 16


def weights_fingerprint(paths: Sequence[Path]) -> str:
    """A hex digest of the weight files ``paths`` (sizes, headers and sampled contents)."""
    h = hashlib.sha256()
    for path in sorted(Path(p) for p in paths):
        size = path.stat().st_size
        h.update(path.name.encode() + b"\0" + struct.pack("<Q", size))
        with open(path, "rb") as f:
            h.update(f.read(_HEAD_BYTES))
            step = max(1, size // _SAMPLES)
            for off in range(0, size, step):
                f.seek(off)
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def weight_files(model_dir: Path, gguf_path: Path | None) -> list[Path]:
    """The files the weights load from: the GGUF, else the checkpoint's safetensors / bin files."""
    if gguf_path is not None:
        return [Path(gguf_path)]
    return sorted(p for p in Path(model_dir).iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))


def tier_seed(model: dict, namespace: str = "") -> bytes:
    """The chain's seed: ``model`` (what every entry of this server shares: name, weights
    fingerprint, dtype, shapes, block, TP layout) and the request's ``namespace``."""
    blob = json.dumps({"model": model, "namespace": namespace}, sort_keys=True).encode()
    return hashlib.sha256(b"llmkit-kv\0" + blob).digest()


def block_keys(seed: bytes, token_ids: Sequence[int], block: int) -> list[bytes]:
    """The keys of the whole blocks of ``token_ids`` (a partial last block has none)."""
    keys, prev = [], seed
    for start in range(0, len(token_ids) - block + 1, block):
        prev = hashlib.sha256(prev + struct.pack(f"<{block}q", *token_ids[start : start + block])).digest()
        keys.append(prev)
    return keys


def random_nonce() -> str:
    """A seed part for weights nothing else can reproduce (``--load-format dummy``)."""
    return os.urandom(16).hex()
