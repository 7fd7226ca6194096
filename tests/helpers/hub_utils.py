"""A Hugging Face hub cache laid out on disk as ``hf download`` leaves it, for offline tests:
``HF_HOME/hub/models--org--name/{refs/main, snapshots/<commit>/, blobs/}``, files linked from the
snapshot to their blobs."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(hf_home: Path) -> Path:
    return Path(hf_home) / "hub"


def hub_snapshot(hf_home: Path, repo_id: str, commit: str = COMMIT, ref: str | None = "main") -> Path:
    """The (empty) snapshot folder of ``repo_id`` at ``commit``, with ``refs/<ref>`` naming it."""
    repo = hub_cache(hf_home) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def link_into_snapshot(snapshot: Path, source: Path, name: str | None = None) -> Path:
    """``source`` as a blob of the snapshot's repository, linked as ``snapshot/name`` (as the hub
    cache stores files); the blob itself links to ``source`` (no copy of a large file)."""
    blob = snapshot.parent.parent / "blobs" / hashlib.sha256(str(source).encode()).hexdigest()
    if not blob.exists():
        os.symlink(Path(source).resolve(), blob)
    link = snapshot / (name or Path(source).name)
    os.symlink(os.path.relpath(blob, snapshot), link)
    return link


def move_into_blobs(snapshot: Path) -> None:
    """The files written into ``snapshot`` moved to blobs and linked back, as the cache keeps them."""
    for f in sorted(p for p in snapshot.iterdir() if p.is_file() and not p.is_symlink()):
        blob = snapshot.parent.parent / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        if not blob.exists():
            os.replace(f, blob)
        else:
            f.unlink()
        os.symlink(os.path.relpath(blob, snapshot), f)
