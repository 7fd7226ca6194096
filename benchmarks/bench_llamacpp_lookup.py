"""llama.cpp's prompt-lookup decoding (``llama-lookup``) against its plain decoding, on the prompts
of ``bench_speculative.py``: the same question for llama.cpp that that script answers for llmkit.

    python benchmarks/bench_llamacpp_lookup.py --llama-cpp-bin /tmp/llamacpp/build/bin [--draft 4]
        [--max-tokens 128] [--threads 2] [--gguf FILE] [--json FILE]

Build (no network but the package registry; about 6 minutes of two cores):

    mkdir -p /tmp/llamacpp && cd /tmp/llamacpp
    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d .
    tar xf llama_cpp_python-0.3.36.tar.gz
    cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \\
        -DGGML_NATIVE=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF \\
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DBUILD_SHARED_LIBS=OFF
    ninja -C build -j2 llama-lookup

Both sides run the same binary: plain is ``llama-lookup --spec-draft-n-max 0`` (the n-gram cache
never proposes a token, so every step decodes one token), lookup is its default (3 draft tokens,
n-grams of 1 to 4 tokens from the prompt and its own output, no static or dynamic cache) or
``--draft N``, passed as ``--spec-draft-n-max N`` (this llama.cpp has removed its ``--draft``).
One process per prompt and side, alternating (plain, lookup) per prompt so drift
hits both alike; greedy (``--temp 0 --top-k 1``), the embedded SmolLM2-135M GGUF, each prompt
wrapped in the chat template as bench_speculative.py does it. Decode tok/s is tokens after the
first over llama-lookup's own decode time (which starts at the first sampled token, after the
prompt), summed over a set, as llmkit's figure is. ``--json`` also keeps every run's counts.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "speculative_prompts.json"


def _run(exe: Path, gguf: Path, prompt_file: Path, args, draft: int | None) -> dict:
    cmd = [str(exe), "-m", str(gguf), "-f", str(prompt_file), "-t", str(args.threads), "-tb", str(args.threads)]
    # llama-lookup stops once it has sampled more than -n tokens: -n 127 gives 128
    cmd += ["-n", str(args.max_tokens - 1), "-c", "2048", "--temp", "0", "--top-k", "1", "--seed", "0"]
    # the prompt is already templated text: no escape processing, no BOS (the GGUF adds none)
    cmd += ["--no-escape"]
    if draft is not None:
        cmd += ["--spec-draft-n-max", str(draft)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")

    def grab(pattern: str) -> re.Match:
        m = re.search(pattern, proc.stderr)
        if not m:
            raise RuntimeError(f"no {pattern!r} in llama-lookup's output:\n{proc.stderr[-2000:]}")
        return m

    enc = grab(r"encoded\s+(\d+) tokens")
    dec = grab(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
    return {
        "prompt_tokens": int(enc[1]),
        "tokens": int(dec[1]),
        "seconds": float(dec[2]),
        "drafted": int(grab(r"n_drafted\s+=\s+(\d+)")[1]),
        "accepted": int(grab(r"n_accept\s+=\s+(\d+)")[1]),
        "text": proc.stdout,  # the prompt, then the generated text
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp-bin", required=True, help="folder holding the built llama-lookup")
    ap.add_argument("--draft", type=int, default=None, help="draft tokens (default: llama-lookup's, 3)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gguf", default=None, help="default: the embedded model's GGUF")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from llmkit.core.model.loader.source import embedded_gguf_path, resolve_model_dir

    exe = Path(args.llama_cpp_bin) / "llama-lookup"
    gguf = Path(args.gguf) if args.gguf else embedded_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(str(gguf), weights=False)))
    prompts = json.loads(DATA.read_text())
    results, runs = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = Path(tmp) / "prompt.txt"
        for name, items in prompts.items():
            totals = {k: [0, 0.0] for k in ("plain", "lookup")}
            drafted = accepted = differ = token_mismatch = 0
            for item in items:
                text = tok.apply_chat_template(
                    [{"role": "user", "content": item["prompt"]}], add_generation_prompt=True, tokenize=False
                )
                n_ids = len(tok(text, add_special_tokens=False)["input_ids"])
                # -f drops one trailing newline, and the template ends in one: give it a spare
                prompt_file.write_text(text + "\n")
                outs = {}
                for label, draft in (("plain", 0), ("lookup", args.draft)):
                    r = _run(exe, gguf, prompt_file, args, draft)
                    totals[label][0] += r["tokens"] - 1
                    totals[label][1] += r["seconds"]
                    token_mismatch += r["prompt_tokens"] != n_ids
                    outs[label] = r.pop("text")
                    runs.append({"set": name, "side": label, **r})
                drafted += r["drafted"]
                accepted += r["accepted"]
                # lookup may run a few tokens past -n (accepted drafts): compare the common length
                n = min(map(len, outs.values()))
                differ += outs["plain"][:n] != outs["lookup"][:n]
            rate = {k: t / s for k, (t, s) in totals.items()}
            results[name] = {
                "plain_tok_s": rate["plain"],
                "lookup_tok_s": rate["lookup"],
                "drafted": drafted,
                "accepted": accepted,
                "differ": differ,
                "prompt_token_mismatch": token_mismatch,
            }

    draft = f"{args.draft} draft tokens" if args.draft is not None else "default draft (3 tokens)"
    print(f"\nllama-lookup, {draft}, {args.max_tokens} tokens, greedy, {args.threads} threads, single stream")
    print(
        "| prompts | decode tok/s, plain | decode tok/s, lookup | ratio | accept rate | drafted / accepted "
        "| outputs that differ |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        ratio = r["lookup_tok_s"] / r["plain_tok_s"]
        accept = r["accepted"] / max(1, r["drafted"])
        print(
            f"| {name} | {r['plain_tok_s']:.1f} | {r['lookup_tok_s']:.1f} | {ratio:.2f}x | {accept:.0%} "
            f"| {r['drafted']} / {r['accepted']} | {r['differ']} |"
        )
    if any(r["prompt_token_mismatch"] for r in results.values()):
        print("warning: llama.cpp tokenized some prompts to a different length than the HF tokenizer")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
