"""A Qwen vision-language config's text settings and its M-RoPE layout."""

from __future__ import annotations

import torch


def text_config(config: dict) -> dict:
    """The language model's settings at the top level (transformers 5 nests them under
    ``text_config``; older checkpoints keep them flat), with ``vision_config`` and the
    multimodal token ids alongside."""
    text = config.get("text_config") or {}
    out = {**{k: v for k, v in config.items() if k != "text_config"}, **text}
    for key in ("rope_scaling", "rope_parameters"):
        params = out.get(key)
        # transformers 4's checkpoints say {"type": "mrope", "mrope_section": ...}: default rope
        # frequencies, the section says which axis each reads
        if params and (params.get("rope_type") or params.get("type")) == "mrope":
            out[key] = {**{k: v for k, v in params.items() if k != "type"}, "rope_type": "default"}
    return out


def mrope_section(config: dict) -> list[int]:
    for key in ("rope_parameters", "rope_scaling"):
        section = (config.get(key) or {}).get("mrope_section")
        if section:
            return [int(s) for s in section]
    raise ValueError("the config has no M-RoPE mrope_section (rope_parameters / rope_scaling)")


def mrope_axis(section: list[int], rotary_dim: int, interleaved: bool = False) -> torch.Tensor:
    """Per rotary column (cos2/sin2 are ``[cos, cos]`` wide) the position axis (0 t, 1 h, 2 w)
    its frequency reads: contiguous bands (Qwen2-VL, Qwen2.5-VL) or, ``interleaved`` (Qwen3-VL),
    t h w t h w ... over the first ``3 * section[1]`` / ``3 * section[2]`` frequencies.
    ``rotary_dim``: the rotated width (the head's, or its first part under partial rotary)."""
    half = rotary_dim // 2
    if sum(section) != half:
        raise ValueError(f"mrope_section {section} does not cover the rotary width / 2 = {half}")
    if interleaved:
        j = torch.arange(half)
        axis = torch.zeros(half, dtype=torch.long)
        axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
        axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
    else:
        axis = torch.repeat_interleave(torch.arange(len(section)) % 3, torch.tensor(section))
    return torch.cat((axis, axis))
