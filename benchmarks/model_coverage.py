"""How much of transformers' decoder-only zoo ``llmkit serve`` loads and matches.

For every model type in the installed transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, the
script builds a tiny random-weight config (``tiny_config``: the class's defaults with small sizes),
saves it, serves it on llmkit's engine (``--model-impl auto``: the native class when llmkit has one,
else the transformers fallback) and compares 8 greedy tokens after a 40-token prompt, and again after
a prompt that hits the prefix cache, with transformers' ``generate``. Each architecture runs in its
own subprocess with a time limit. The share is over decoder-only text architectures: the decoder
halves of encoder-decoder models, encoder models with an LM head, speech, music and image-token models
are listed apart (``NOT_DECODER_ONLY``) and not counted.

    python benchmarks/model_coverage.py [--only gpt_neox,falcon] [--jobs 2] [--out coverage.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Causal-LM classes that are not decoder-only text LMs: encoders with an LM head, the decoder half
# of an encoder-decoder, speech / music / OCR models.
NOT_DECODER_ONLY = {
    "bart", "bert", "bert-generation", "big_bird", "bigbird_pegasus", "blenderbot", "blenderbot-small",
    "camembert", "data2vec-text", "electra", "ernie", "marian", "mbart", "megatron-bert", "musicgen",
    "musicgen_melody", "mvp", "pegasus", "plbart", "prophetnet", "rembert", "roberta",
    "roberta-prelayernorm", "roc_bert", "roformer", "trocr", "whisper", "xlm", "xlm-roberta",
    "xlm-roberta-xl", "xmod", "moshi", "moss_transcribe_diarize", "xlnet", "reformer", "git",
}  # fmt: skip

SMALL = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
    # mixture-of-experts fields under their several names
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    moe_num_experts=4, moe_k=2, moe_topk=2, shared_expert_intermediate_size=32, n_shared_experts=1,
    first_k_dense_replace=1, n_group=1, topk_group=1,
    # latent attention (DeepSeek-style) heads that fit the small ones
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=32, q_lora_rank=32,
    # token ids inside the small vocabulary (some defaults point past it)
    pad_token_id=0, bos_token_id=1, eos_token_id=2, rotary_dim=8,
)  # fmt: skip


def tiny_config(model_type: str):
    """The config class's defaults with the sizes above (those it has a field for); a config with
    a layer pattern keeps its first four layers' kinds (a hybrid keeps an attention layer)."""
    import transformers

    cls = transformers.CONFIG_MAPPING[model_type]
    base = cls()
    if getattr(base, "text_config", None) is not None:
        raise ValueError("a composite (multimodal) config")
    settable = lambda k: not isinstance(getattr(cls, k, None), property)  # noqa: E731 (derived fields)
    kw = {k: v for k, v in SMALL.items() if hasattr(base, k) and settable(k)}
    pattern = list(getattr(base, "layer_types", None) or [])
    if pattern:
        kw["num_hidden_layers"] = 4
        kw["layer_types"] = (pattern * 4)[:4] if "full_attention" in pattern[:4] or len(set(pattern)) == 1 else None
    try:
        cfg = cls(**{k: v for k, v in kw.items() if v is not None})
    except Exception:  # a per-layer field (Gemma 4's head sizes) that the class derives itself
        kw.pop("head_dim", None)
        cfg = cls(**{k: v for k, v in kw.items() if v is not None})
    return cfg


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + 11 * i) % 500 + 1 for i in range(n)]


def check_one(model_type: str, workdir: str) -> dict:
    """Save a tiny ``model_type`` and compare llmkit's greedy tokens with transformers'."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "tests" / "helpers"))
    from llmkit.core.engine.stages.plan import model_class

    from model_utils import assert_greedy_matches_generate, copy_embedded_tokenizer

    torch.manual_seed(0)
    cfg = tiny_config(model_type)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(workdir)
    copy_embedded_tokenizer(workdir)
    config = json.loads((Path(workdir) / "config.json").read_text())
    impl = model_class(config).__name__
    kind = "fallback" if impl == "TransformersForCausalLM" else "native"
    first = _prompt(1, 40)
    cached = assert_greedy_matches_generate(model.eval(), workdir, [first, first + _prompt(2, 5)], n=8)
    assert cached[1] > 0, "the second prompt should hit the prefix cache"
    return {"kind": kind, "class": impl}


def run(model_type: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, __file__, "--child", model_type, "--workdir", tmp]
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
        except subprocess.TimeoutExpired:
            return {"model_type": model_type, "ok": False, "reason": f"timed out after {timeout:.0f} s"}
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode == 0 and lines:
            return {"model_type": model_type, "ok": True, **json.loads(lines[-1]), "s": time.monotonic() - t0}
        err = [ln for ln in p.stderr.strip().splitlines() if ln.strip() and "it/s]" not in ln and "shard" not in ln]
        err = [ln for ln in err if "Error" in ln] or err
        return {"model_type": model_type, "ok": False, "reason": (err[-1] if err else f"exit {p.returncode}")[:300]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=180)
    ap.add_argument("--out", default="")
    ap.add_argument("--child", default="")
    ap.add_argument("--workdir", default="")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(check_one(args.child, args.workdir)))
        return
    from concurrent.futures import ThreadPoolExecutor

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = sorted(args.only.split(",")) if args.only else sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    counted = [t for t in types if t not in NOT_DECODER_ONLY]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda t: run(t, args.timeout), counted))
    for r in results:
        status = f"{r['kind']:8s} {r['class']}" if r["ok"] else f"FAIL     {r['reason']}"
        print(f"{r['model_type']:28s} {status}")
    ok = [r for r in results if r["ok"]]
    native = sum(r["kind"] == "native" for r in ok)
    n = len(counted)
    print(f"\n{len(ok)}/{n} decoder-only text architectures served and matching ({100 * len(ok) / max(n, 1):.1f} %): "
          f"{native} native, {len(ok) - native} on the transformers fallback; {len(types) - n} not counted")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
