"""Which construct makes MLA extend with page size 1 wrong when compiled (issue 34 item 2)?

Runs variants of tests/test_triton_attention.py's ``extend_ps1_latent`` case on CUDA and prints, for
each, the Triton kernel's and the torch backend's max abs error against the torch backend run on
the CPU over the same batch (so a wrong reference shows as well as a wrong kernel)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_triton_attention import CASES, _backends, _build  # noqa: E402

from llmkit.plugins.attention.torch_backend import TorchAttentionBackend  # noqa: E402

from attention_utils import backend_kwargs  # noqa: E402

BASE = CASES["extend_ps1_latent"]
# a dry run on CPU: LLMKIT_TRITON_INTERPRET=1 TRITON_INTERPRET=1 (the interpreter stands in for CUDA)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
VARIANTS = {
    "orig": {},
    "no_decode_row": dict(seqs=[(0, 19), (21, 5)]),
    "decode_row_only": dict(seqs=[(7, 1), (21, 5)]),
    "page16": dict(page_size=16),
    "head_dim64": dict(head_dim=64),
    "head_dim72": dict(head_dim=72),
    "not_latent": dict(latent=None),
    "group4": dict(heads=(4, 1)),
    "q_len_over_16": dict(seqs=[(0, 33), (21, 5)]),
}


def run(name: str, over: dict, dtype: torch.dtype) -> str:
    spec = {**BASE, **over}
    if spec.get("latent") is None:
        spec.pop("latent", None)
    outs = {}
    for dev in (DEV, "ref"):
        b = _build(spec, "cpu" if dev == "ref" else dev, dtype)
        if dev != "ref":
            tri, ref = _backends(b, spec["heads"][0], v_head_dim=spec.get("latent"))
            outs["triton"] = tri.forward(b.q, b.k, b.v, 0, tri.prepare_metadata(b.md)).float().cpu()
            b.md.extra.clear()
        else:  # the reference: the torch backend on the CPU (no Triton there)
            ref = TorchAttentionBackend(**backend_kwargs(b, spec["heads"][0], spec.get("latent")))
        outs["torch_cpu" if dev == "ref" else f"torch_{dev}"] = (
            ref.forward(b.q, b.k, b.v, 0, ref.prepare_metadata(b.md)).float().cpu()
        )
    want = outs["torch_cpu"]
    errs = {k: (v - want).abs().max().item() for k, v in outs.items() if k != "torch_cpu"}
    worst = (outs["triton"] - want).abs().amax(dim=(1, 2))
    rows = torch.nonzero(worst > 5e-2).flatten().tolist()
    return (
        f"{name:16s} {str(dtype):15s} " + " ".join(f"{k}={v:.3g}" for k, v in errs.items()) + f" bad_rows={rows[:40]}"
    )


if __name__ == "__main__":
    for dtype in (torch.float16, torch.float32):
        for name, over in VARIANTS.items():
            try:
                print(run(name, over, dtype), flush=True)
            except Exception as exc:  # noqa: BLE001 (a probe: report and go on)
                print(f"{name:16s} {dtype} ERROR {type(exc).__name__}: {exc}", flush=True)
