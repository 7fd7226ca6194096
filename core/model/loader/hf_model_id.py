"""The Hugging Face id (``org/name``) of a local model, when its path or config names it.

Clients written for SGLang send the hub id as ``model`` (SGLang loads models by id), so the server
accepts a model's id besides its served names. Only signals that name the repository count, and
the first that gives an id wins:

1. a hub-cache path, ``.../models--org--name/snapshots/<revision>/...`` (where huggingface_hub
   downloads to; a GGUF file inside one counts too);
2. a directory ``.../org/name`` (``hf download org/name --local-dir models/org/name``) whose two
   last parts look like an id and whose ``org`` folder is no generic one: not named like
   ``models``, ``tmp``, ``checkpoints`` (:data:`GENERIC_FOLDERS`), and not a top-level folder
   (``/data``), someone's home (``/home/alice``), the temp or the current directory;
3. config.json's ``_name_or_path`` when it is such an ``org/name`` id (transformers records there
   the id a model was loaded from; last, as a fine-tune's may name its base model).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

# A hub name part: letters, digits, "-", "_", "." (no "--" or "..", which the hub refuses), <= 96.
_PART = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9][A-Za-z0-9._-]{0,95}")

# Folder names that hold models rather than name an organization (compared lowercased).
GENERIC_FOLDERS = frozenset(
    "models model llm llms checkpoints checkpoint ckpt ckpts weights hub hf huggingface cache downloads "
    "download tmp temp data home users root mnt media opt srv var usr local share work workspace src "
    "output outputs out runs snapshots gguf".split()
)


def hf_model_id(model_path: str | None) -> str | None:
    """The id of the model at ``model_path`` (None: the embedded model), or None if unknown."""
    if model_path is None:
        from llmkit.core.model.loader.source import EMBEDDED_HF_ID

        return EMBEDDED_HF_ID
    path = Path(os.path.abspath(Path(model_path).expanduser()))  # ".." folded, symlinks kept
    repo = path.parent if path.suffix == ".gguf" else path
    if any(part.startswith("models--") for part in repo.parts):
        return _hub_cache_id(repo)  # in a hub cache its layout names the model, or nothing does
    return _org_dir_id(repo) or _config_id(repo)


def _is_id(parts: list[str]) -> bool:
    return all(_PART.fullmatch(p) for p in parts)


def _hub_cache_id(path: Path) -> str | None:
    parts = path.parts
    for i, part in enumerate(parts[:-2]):
        if part.startswith("models--") and parts[i + 1] == "snapshots":
            name = part.removeprefix("models--").split("--")  # "--" cannot occur inside a part
            return "/".join(name) if len(name) <= 2 and _is_id(name) else None
    return None


def _org_dir_id(path: Path) -> str | None:
    org = path.parent
    if not _is_id([org.name, path.name]) or _generic(org):
        return None
    return f"{org.name}/{path.name}"


def _generic(org: Path) -> bool:
    return (
        org.name.lower() in GENERIC_FOLDERS
        or org.parent == Path(org.anchor)
        or org.parent.name in ("home", "Users")
        or org in (Path.home(), Path(tempfile.gettempdir()), Path.cwd())
    )


def _config_id(path: Path) -> str | None:
    try:
        name = json.loads((path / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(name, str) or name.count("/") != 1:
        return None
    org, model = name.split("/")
    return name if _is_id([org, model]) and org.lower() not in GENERIC_FOLDERS else None
