"""Sampling defaults, decided in one place for every generating route.

A request that leaves out ``temperature``, ``top_p``, ``top_k``, ``min_p`` or
``repetition_penalty`` (or sends it as ``null``: OpenAI's schema makes them nullable, and a null
means "the default") gets the server's default; a value it sends always wins. The server's
defaults are the model's ``generation_config.json`` where it sets them, else the neutral values
(temperature 1, top_p 1, top_k -1, min_p 0, repetition_penalty 1), as vLLM applies them on every
route. ``--generation-config`` picks the file as vLLM's switch of that name does:

* ``auto`` (the default): the model directory's ``generation_config.json``;
* ``vllm`` (or ``none``): no file, the neutral values;
* a path: a directory holding ``generation_config.json``, or the file itself.

Chat completions, completions, Responses, Anthropic Messages, SGLang's ``/generate`` and the
batch lines (served by the chat and completions routes) all resolve through :func:`resolve`;
no route or request model declares a default of its own.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("llmkit")

FILE_NAME = "generation_config.json"
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# What a request gets when neither it nor the generation config sets a field (OpenAI's, vLLM's
# and SGLang's neutral sampling: the model's distribution as it is).
NEUTRAL: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
AUTO = "auto"
NO_FILE = ("vllm", "none")


def resolve(req: Any, defaults: Mapping[str, float | int] | None = None) -> dict[str, float | int]:
    """The effective sampling fields of a request: each one the request sent (a value, not null),
    else ``defaults``' (the generation config's), else the neutral value.

    ``req`` is a request model (its attributes) or a mapping (a body as sent); a field it does
    not have or holds as None was not sent. The values are not range-checked here: the sampling
    checks (``generation/sampling.py``) check the effective values, whichever side they came from.
    """
    get = req.get if isinstance(req, Mapping) else lambda name: getattr(req, name, None)
    out: dict[str, float | int] = {}
    for name in FIELDS:
        value = get(name)
        if value is None:
            value = (defaults or {}).get(name)
        out[name] = NEUTRAL[name] if value is None else value
    return out


def generation_config_path(setting: str, model_dir: Path | str | None) -> Path | None:
    """The generation config ``setting`` names: None for ``vllm``/``none`` (and for ``auto`` where
    the model has none); a path that holds none is an error (it was asked for by name)."""
    if setting in NO_FILE:
        return None
    if setting == AUTO:
        if model_dir is None:
            return None
        path = Path(model_dir) / FILE_NAME
        return path if path.is_file() else None
    path = Path(setting).expanduser()
    if path.is_dir():
        path = path / FILE_NAME
    if not path.is_file():
        raise ValueError(
            f"--generation-config {setting}: no {FILE_NAME} there (give auto, vllm, "
            f"a directory holding {FILE_NAME}, or the file)"
        )
    return path


def read_generation_config(path: Path) -> dict[str, float | int]:
    """The sampling fields a generation config sets, checked as a request's would be (a bad
    value fails at start-up, not on every request). ``do_sample: false`` means greedy (temperature
    0), as in transformers; ``top_k`` 0 means no top-k there, -1 here."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON generation config ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: a generation config is a JSON object")
    out: dict[str, float | int] = {}
    for name in FIELDS:
        value = cfg.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{path}: {name} must be a finite number, not {value!r}")
        out[name] = value
    if out.get("top_k") == 0:
        out["top_k"] = -1
    if cfg.get("do_sample") is False:
        out["temperature"] = 0.0
    _check(path, out)
    if "top_k" in out:
        out["top_k"] = int(out["top_k"])
    return out


def _check(path: Path, values: dict) -> None:
    bad = []
    if values.get("temperature", 1.0) < 0:
        bad.append("temperature must be >= 0")
    if not 0 < values.get("top_p", 1.0) <= 1:
        bad.append("top_p must be in (0, 1]")
    top_k = values.get("top_k", -1)
    if top_k != -1 and (top_k < 1 or top_k != int(top_k)):
        bad.append("top_k must be -1, 0 (no top-k) or a positive integer")
    if not 0 <= values.get("min_p", 0.0) <= 1:
        bad.append("min_p must be in [0, 1]")
    if not 0 < values.get("repetition_penalty", 1.0) <= 2:
        bad.append("repetition_penalty must be in (0, 2]")
    if bad:
        raise ValueError(f"{path}: {'; '.join(bad)}")


def load_sampling_defaults(setting: str, model_dir: Path | str | None) -> dict[str, float | int]:
    """The server's sampling defaults under ``--generation-config setting``: the fields the
    chosen file sets (an empty dict: the neutral values throughout). Logged when they differ from
    the neutral ones, since they change what an unconfigured request samples."""
    path = generation_config_path(setting, model_dir)
    if path is None:
        return {}
    values = read_generation_config(path)
    changed = {k: v for k, v in values.items() if v != NEUTRAL[k]}
    if changed:
        shown = ", ".join(f"{k}={v}" for k, v in changed.items())
        log.info(
            "Sampling defaults from %s: %s (a request's own values win; --generation-config vllm ignores the file)",
            path,
            shown,
        )
    return values


def effective_defaults(defaults: Mapping[str, float | int] | None) -> dict[str, float | int]:
    """Every field's default as a request that sends none gets it (for /get_server_info)."""
    return resolve({}, defaults)
