"""The server on CUDA with the official openai client: stream = non-stream, n with a seed,
logprobs, json_schema, a reasoning parser, /v1/responses. SmolLM2's tokenizer and chat template
on a 4-layer model of its shape with dummy weights (the answers are noise; the API is checked).

    python benchmarks/gpu_check/functional.py TOKENIZER_DIR
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "helpers"))
from server_utils import server_log, start_server, stop_server  # noqa: E402

CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", vocab_size=49152,
    hidden_size=576, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def main(tok_dir: str) -> int:
    d = Path(tempfile.mkdtemp())
    for f in Path(tok_dir).iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (d / "config.json").write_text(json.dumps(CONFIG))
    args = ["--model-path", str(d), "--load-format", "dummy", "--reasoning-parser", "qwen3", "--batch-storage", "none"]
    proc, url = start_server(args, timeout=300)
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "List three colours."}]
    results = {}

    def check(name, fn):
        try:
            fn()
            results[name] = "ok"
        except Exception as exc:  # noqa: BLE001 (report every check)
            results[name] = f"FAIL {type(exc).__name__}: {exc}"
        print(f"{name}: {results[name]}", flush=True)

    def stream_equals_non_stream():
        full = c.chat.completions.create(model="m", messages=msgs, max_tokens=24, temperature=0)
        parts = c.chat.completions.create(model="m", messages=msgs, max_tokens=24, temperature=0, stream=True)
        text = "".join((ch.choices[0].delta.content or "") for ch in parts if ch.choices)
        assert text == (full.choices[0].message.content or ""), (text, full.choices[0].message.content)

    def n_with_seed():
        a = c.chat.completions.create(model="m", messages=msgs, max_tokens=12, n=3, seed=7, temperature=1)
        b = c.chat.completions.create(model="m", messages=msgs, max_tokens=12, n=3, seed=7, temperature=1)
        assert len(a.choices) == 3 and [x.message.content for x in a.choices] == [x.message.content for x in b.choices]

    def logprobs():
        r = c.chat.completions.create(model="m", messages=msgs, max_tokens=5, logprobs=True, top_logprobs=3)
        lp = r.choices[0].logprobs.content
        assert len(lp) == 5 and all(len(t.top_logprobs) == 3 for t in lp)

    def json_schema():
        schema = {"type": "object", "properties": {"name": {"enum": ["red", "green"]}}, "required": ["name"]}
        fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
        r = c.chat.completions.create(model="m", messages=msgs, max_tokens=64, response_format=fmt, temperature=0)
        assert json.loads(r.choices[0].message.content)["name"] in ("red", "green")

    def reasoning_field():
        r = c.chat.completions.create(model="m", messages=msgs, max_tokens=8)
        assert hasattr(r.choices[0].message, "reasoning_content")

    def responses():
        r = c.responses.create(model="m", input="Say hi.", max_output_tokens=8)
        assert r.status in ("completed", "incomplete") and r.output

    try:
        for fn in (stream_equals_non_stream, n_with_seed, logprobs, json_schema, reasoning_field, responses):
            check(fn.__name__, fn)
    finally:
        stop_server(proc)
    if any(v != "ok" for v in results.values()):
        print(server_log(proc, tail=3000))
    return 0 if all(v == "ok" for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
