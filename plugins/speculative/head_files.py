"""Reading a draft model's or head's directory (STANDALONE, EAGLE, EAGLE3): where it is, its tensors,
their places."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn


def head_dir(draft_model_path: str | None, algorithm: str, what: str) -> Path:
    """``--speculative-draft-model-path`` as a directory with a ``config.json``, or a clear error."""
    if not draft_model_path:
        raise ValueError(f"{algorithm} speculation needs --speculative-draft-model-path ({what})")
    path = Path(draft_model_path).expanduser()
    if not (path / "config.json").exists():
        raise ValueError(f"--speculative-draft-model-path {draft_model_path}: no config.json there")
    return path


def head_config(draft_model_path: str | None, algorithm: str, what: str, target_model) -> tuple[Path, dict]:
    """A head's directory and its ``config.json``, for a target whose hidden states it can read."""
    path = head_dir(draft_model_path, algorithm, what)
    if target_model is None or not getattr(target_model, "supports_feature_capture", False):
        raise ValueError(f"{algorithm} needs a target model whose hidden states can be captured (Llama-style models)")
    return path, json.loads((path / "config.json").read_text())


def load_tensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    """The head's tensors from safetensors or ``pytorch_model.bin``, a ``model.`` prefix dropped."""
    out: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        for f in files:
            out.update(load_file(str(f)))
    elif (path / "pytorch_model.bin").exists():
        out.update(torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True))
    else:
        raise ValueError(f"{what} head {path}: no *.safetensors or pytorch_model.bin")
    return {k.removeprefix("model."): v for k, v in out.items()}


def place(head: nn.Module, tensors: dict, names: dict[str, str], skip: set[str], what: str, layout: str) -> None:
    """Copy each checkpoint tensor to the parameter ``names`` maps it to (``skip``: read elsewhere
    or unused); any other tensor, a wrong shape or a parameter left unloaded is a clear error."""
    params = dict(head.named_parameters())
    missing = {v for v in names.values() if v in params}
    for name, tensor in tensors.items():
        if name in skip:
            continue
        ours = names.get(name)
        if ours is None or ours not in params:
            raise ValueError(f"{what} head: unexpected tensor {name!r} (is this {layout} checkpoint?)")
        if params[ours].shape != tensor.shape:
            raise ValueError(
                f"{what} head: {name} is {tuple(tensor.shape)}, the config says {tuple(params[ours].shape)}"
            )
        with torch.no_grad():
            params[ours].copy_(tensor)
        missing.discard(ours)
    if missing:
        raise ValueError(f"{what} head: missing {', '.join(sorted(missing))}")


def shared_embedding(
    target_model, tensors: dict, device: torch.device, dtype: torch.dtype, what: str, target_vocab=None
) -> nn.Module:
    """The head's own embedding where its checkpoint carries one, else the target's: under tensor
    parallelism the copy gathered for rank 0 (``target_vocab``), since the target's own is split
    over the ranks and only rank 0 drafts."""
    if "embed_tokens.weight" in tensors:
        weight = tensors.pop("embed_tokens.weight").to(device=device, dtype=dtype)
        return nn.Embedding.from_pretrained(weight, freeze=True)
    return target_embedding(target_model, target_vocab, what)


def target_embedding(target_model, target_vocab, what: str) -> nn.Module:
    """The target's token embedding as rank 0 may call it alone."""
    if target_vocab is not None:
        return target_vocab.embed
    if target_model.tp.size > 1:  # (the builder gathers it for a proposer that reads_target_vocab)
        raise ValueError(f"{what} under --tp-size > 1: the target's embedding was not gathered for rank 0")
    return target_model.embed_tokens
