"""Pooling token states into one vector, configured as sentence-transformers configures it:
``modules.json`` lists the modules (a ``Pooling`` one with its ``config.json``, a ``Normalize``
one or not), so a model served here gives the vectors ``SentenceTransformer.encode`` gives."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# sentence-transformers' pooling_mode_* flags -> our mode names (the ones we implement)
_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}


@dataclass(frozen=True)
class Pooling:
    mode: str = "mean"  # mean | cls | last
    normalize: bool = False  # an L2-normalised vector (a Normalize module follows the pooling)

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        """One vector from one input's ``[tokens, hidden]`` states."""
        if self.mode == "cls":
            v = states[0]
        elif self.mode == "last":
            v = states[-1]
        else:
            v = states.mean(dim=0)
        return F.normalize(v, dim=0) if self.normalize else v


def read_pooling(model_dir: Path) -> Pooling:
    """The model's pooling from ``modules.json``; without one, mean pooling and no normalisation
    (what sentence-transformers builds for a plain transformers checkpoint)."""
    modules_file = model_dir / "modules.json"
    if not modules_file.exists():
        return Pooling()
    modules = json.loads(modules_file.read_text())
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
    normalize = "Normalize" in kinds
    if "Pooling" not in kinds:
        return Pooling(normalize=normalize)
    cfg = json.loads((model_dir / kinds["Pooling"].get("path", "") / "config.json").read_text())
    chosen = [flag for flag, on in cfg.items() if flag.startswith("pooling_mode_") and on]
    unsupported = [flag for flag in chosen if flag not in _MODES]
    if unsupported or len(chosen) != 1:
        raise ValueError(
            f"{model_dir.name}: pooling {', '.join(chosen) or '(none)'} is not supported; one of {', '.join(_MODES)} is"
        )
    return Pooling(_MODES[chosen[0]], normalize)


def override_pooling(pooling: Pooling, pooler_config: str | None) -> Pooling:
    """``pooling`` with what ``--pooler-config`` sets (vLLM's JSON: ``pooling_type`` MEAN, CLS or
    LAST; ``normalize`` true or false), for a checkpoint whose files say something else or nothing."""
    if not pooler_config:
        return pooling
    try:
        cfg = json.loads(pooler_config)
    except ValueError as exc:
        raise ValueError(f"--pooler-config is not JSON: {exc}") from None
    if not isinstance(cfg, dict) or set(cfg) - {"pooling_type", "normalize"}:
        raise ValueError('--pooler-config takes {"pooling_type": "MEAN" | "CLS" | "LAST", "normalize": true | false}')
    mode, normalize = pooling.mode, cfg.get("normalize", pooling.normalize)
    if "pooling_type" in cfg:
        mode = str(cfg["pooling_type"]).lower()
        if mode not in _MODES.values():
            raise ValueError(f"--pooler-config: pooling_type '{cfg['pooling_type']}' is not one of MEAN, CLS, LAST")
    if not isinstance(normalize, bool):
        raise ValueError("--pooler-config: normalize is true or false")
    return Pooling(mode, normalize)


def max_input_tokens(model_dir: Path, max_position: int) -> int:
    """The longest input served: sentence-transformers' ``max_seq_length`` where the model sets
    one (it truncates there; we refuse longer inputs rather than embed a different text), else the
    position embeddings' reach."""
    path = model_dir / "sentence_bert_config.json"
    if path.exists():
        limit = json.loads(path.read_text()).get("max_seq_length")
        if isinstance(limit, int) and limit > 0:
            return min(limit, max_position)
    return max_position


def matryoshka_dimensions(config: dict) -> tuple[int, ...] | None:
    """The dimensions a Matryoshka model may be truncated to: ``matryoshka_dimensions`` in
    config.json, or any when it says ``is_matryoshka`` (vLLM's reading); None: not Matryoshka."""
    dims = config.get("matryoshka_dimensions")
    if dims:
        return tuple(int(d) for d in dims)
    if config.get("is_matryoshka"):
        return tuple(range(1, config["hidden_size"] + 1))
    return None
