"""``--model-path org/name`` (and ``org/repo:QUANT``, llama.cpp's ``-hf`` form for a GGUF file):
a model named by its Hugging Face id, resolved through ``huggingface_hub`` to a local path.

A path that exists locally always wins over an id. Otherwise the id is looked up as every peer
does: downloaded where the network allows (only the files a model needs, or the one GGUF a tag
names, never a GGUF repository's every quantization), read from the hub cache under ``HF_HOME``
when ``HF_HUB_OFFLINE=1`` or the hub cannot be reached (``snapshot_download`` falls back to the
cache by itself). A GGUF tag picks the ``.gguf`` whose name holds it, case-insensitively, as
llama.cpp does; without a tag a repository with no config.json but GGUF files gets ``Q4_K_M``,
else its first one.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from llmkit.core.model.loader.hf_model_id import _is_id

log = logging.getLogger("llmkit")

# org/name, optionally ":TAG" (a quantization such as Q4_K_M); parts as the hub allows them.
_HUB_REF = re.compile(r"(?P<org>[^/:\s]+)/(?P<name>[^/:\s]+)(?::(?P<tag>[A-Za-z0-9_.-]+))?")
DEFAULT_GGUF_TAG = "Q4_K_M"  # llama.cpp's -hf default
# What a safetensors model needs; a repository's other formats (.bin, .pth, original/, onnx/) are not fetched.
_MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


class HubModelNotFound(FileNotFoundError):
    """A hub id that is neither local, in the hub cache, nor downloadable; the message says where it looked."""


def parse_hub_ref(model_path: str) -> tuple[str, str | None] | None:
    """``(repo_id, tag)`` when ``model_path`` reads as a hub id (and is no local path), else None."""
    if Path(model_path).expanduser().exists():
        return None
    m = _HUB_REF.fullmatch(model_path)
    if m is None or not _is_id([m["org"], m["name"]]):
        return None
    return f"{m['org']}/{m['name']}", m["tag"]


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def resolve_hub_model(model_path: str, revision: str | None = None) -> str:
    """The local path (a snapshot directory, or a GGUF file inside one) of hub id ``model_path``;
    raises :class:`HubModelNotFound` naming the places it looked."""
    ref = parse_hub_ref(model_path)
    if ref is None:
        raise ValueError(f"'{model_path}' is not a Hugging Face model id (org/name or org/name:QUANT)")
    repo_id, tag = ref
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        snapshot = _snapshot(repo_id, tag, revision)
    except (LocalEntryNotFoundError, RepositoryNotFoundError, HFValidationError, OSError) as exc:
        raise HubModelNotFound(_not_found(model_path, repo_id, revision, exc)) from None
    if tag is None and (snapshot / "config.json").exists():
        return str(snapshot)
    gguf = pick_gguf(sorted(p.name for p in snapshot.glob("*.gguf")), tag)
    if gguf is None:
        what = f"no .gguf file tagged {tag}" if tag else "neither config.json nor a .gguf file"
        raise HubModelNotFound(f"--model-path '{model_path}': {snapshot} holds {what}")
    return str(snapshot / gguf)


def _snapshot(repo_id: str, tag: str | None, revision: str | None) -> Path:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    if offline():
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    try:
        # one request (model_info lists the files; list_repo_files retries for ~25 s when offline)
        siblings = HfApi().model_info(repo_id, revision=revision, timeout=30).siblings or []
        files = [s.rfilename for s in siblings]
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise
    except Exception as exc:  # no network, a proxy, a timeout: what the cache holds, as snapshot_download does
        log.info("The Hugging Face hub did not answer (%s); looking in the cache for %s", type(exc).__name__, repo_id)
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    if tag is None and "config.json" in files:
        patterns = _MODEL_FILES
    else:  # the one GGUF file, and the tokenizer files some GGUF repositories keep beside it
        chosen = pick_gguf([f for f in files if "/" not in f and f.endswith(".gguf")], tag)
        patterns = [chosen, "tokenizer*", "special_tokens_map.json"] if chosen else ["*.json"]
    return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))


def pick_gguf(names: list[str], tag: str | None) -> str | None:
    """The GGUF file ``tag`` names among ``names`` (llama.cpp's rule: the name contains the tag,
    case-insensitively; multimodal projectors never); without a tag Q4_K_M, else the first."""
    names = [n for n in names if not n.lower().startswith("mmproj")]
    wanted = (tag or DEFAULT_GGUF_TAG).lower()
    for name in names:
        if wanted in name.lower():
            return name
    return names[0] if names and tag is None else None


def _not_found(model_path: str, repo_id: str, revision: str | None, exc: Exception) -> str:
    from huggingface_hub import constants

    local = os.path.abspath(os.path.expanduser(model_path))
    at = f" at revision '{revision}'" if revision else ""
    how = "HF_HUB_OFFLINE=1: nothing is downloaded" if offline() else f"nor downloaded: {type(exc).__name__}"
    return (
        f"--model-path '{model_path}' was not found: no local path {local}, and {repo_id}{at} is not in "
        f"the Hugging Face cache {constants.HF_HUB_CACHE} ({how}). Give a local model directory or .gguf file, "
        f"or fetch it first: hf download {repo_id}"
    )
