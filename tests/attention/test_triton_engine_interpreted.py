"""``llmkit serve --attention triton`` end to end on CPU, with the kernels in Triton's interpreter
(``LLMKIT_TRITON_INTERPRET=1``), against the same server on the torch reference backend.

A tiny random-weight Llama keeps the interpreted launches few. Two requests share a prompt prefix,
so the second one's prefill runs the extend kernel over pages the radix cache handed it; decode
steps run the split-K kernel; page size 4 puts sequences across page boundaries. Tiny gpt-oss
and DeepSeek-V3 models do the same with prompts longer than gpt-oss's window (sinks, sliding
windows, latent KV), and a tiny Qwen2 its QKV bias.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from model_utils import copy_embedded_tokenizer, save_tiny_model
from server_utils import server_log, start_server, stop_server

PREFIX = [(29 * i + 5) % 500 + 3 for i in range(13)]
PROMPTS = [PREFIX + [7, 8, 9], PREFIX + [100, 200]]


def _generate(model_dir, attention: str, env: dict | None = None, prompts=PROMPTS) -> tuple[list[dict], str]:
    proc, url = start_server(
        [
            "--model-path",
            str(model_dir),
            "--attention",
            attention,
            "--page-size",
            "4",
            "--max-total-tokens",
            "256",
            "--batch-storage",
            "none",
        ],
        env=env,
    )
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)

        def one(prompt):
            r = client.completions.create(
                model="m", prompt=prompt, max_tokens=4, temperature=0, logprobs=1, extra_body={"ignore_eos": True}
            )
            c = r.choices[0]
            return {
                "tokens": c.logprobs.tokens,
                "logprobs": c.logprobs.token_logprobs,
                "cached": r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0,
            }

        first = one(prompts[0])  # fills the radix cache with the shared prefix
        with ThreadPoolExecutor(2) as ex:  # then a batch of two: one extend over cached pages
            rest = list(ex.map(one, prompts))
        return [first, *rest], server_log(proc, tail=100_000)
    finally:
        stop_server(proc)


def test_triton_interpreted_serve_matches_torch(tiny_llama):
    ref, _ = _generate(tiny_llama, "torch")
    got, log = _generate(tiny_llama, "triton", env={"LLMKIT_TRITON_INTERPRET": "1"})
    assert "attention triton" in log
    assert [g["tokens"] for g in got] == [r["tokens"] for r in ref]
    for g, r in zip(got, ref):
        assert g["logprobs"] == pytest.approx(r["logprobs"], abs=1e-3)
    assert got[2]["cached"] >= 12  # the second prompt really reused the first one's pages


# Longer than the tiny gpt-oss's 16-token window, with a shared prefix over several pages.
LONG_PREFIX = [(31 * i + 7) % 500 + 3 for i in range(21)]
LONG_PROMPTS = [LONG_PREFIX + [7, 8, 9], LONG_PREFIX + [100, 200]]


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3", "qwen2"])
def test_new_families_serve_on_triton_interpreted(arch, tmp_path):
    """gpt-oss (sinks, sliding windows) and DeepSeek-V3 (latent KV) start with ``--attention
    triton`` (the backend declares the features they need) and generate what the torch backend
    does, through the radix cache, extend and decode kernels; Qwen2 too, its QKV bias folded into
    the kernel that rotates and stores K/V."""
    save_tiny_model(arch, tmp_path)
    copy_embedded_tokenizer(tmp_path)
    ref, _ = _generate(tmp_path, "torch", prompts=LONG_PROMPTS)
    got, log = _generate(tmp_path, "triton", env={"LLMKIT_TRITON_INTERPRET": "1"}, prompts=LONG_PROMPTS)
    assert "attention triton" in log
    assert [g["tokens"] for g in got] == [r["tokens"] for r in ref]
    for g, r in zip(got, ref):
        assert g["logprobs"] == pytest.approx(r["logprobs"], abs=1e-3)
    assert got[2]["cached"] >= 20
