"""Shared fixtures: real ``llmkit serve`` subprocesses with the embedded model, talked to with the
official ``openai`` client."""

from __future__ import annotations

import dataclasses

import httpx
import openai
import pytest

from server_utils import server_log, start_server, stop_server


@dataclasses.dataclass
class Server:
    proc: object
    base_url: str
    api_key: str = "None"

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=self.api_key, max_retries=0, timeout=300)

    @property
    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key=self.api_key, max_retries=0, timeout=300)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=300)

    def info(self) -> dict:
        return httpx.get(self.base_url + "/get_server_info", timeout=30).json()

    def log(self) -> str:
        return server_log(self.proc, tail=200_000)


def _server(args: list[str]):
    proc, url = start_server(args)
    try:
        yield Server(proc, url)
    finally:
        stop_server(proc)


@dataclasses.dataclass
class InProcessServer:
    """The real app over a FakeEngineClient, called in-process (no socket, no model)."""

    app: object

    def http(self):
        from fastapi.testclient import TestClient

        return TestClient(self.app)

    @property
    def engine(self):
        return self.app.state.llmkit.client


# The fast tier, for the edit-test loop (``python -m pytest -q -m "not slow"``, docs/testing.md),
# leaves out the tests marked slow by hand and these modules, each of which took 8 s or more in all
# (``--durations``, the quiet 2-core machine, 2026-12-07): servers of their own, spawned ranks and
# replicas, kill -9 recoveries, Triton's interpreter. CI runs everything.
SLOW_MODULES = frozenset(
    {
        "tests/audio/test_transcription_server.py",
        "tests/audio/test_whisper.py",
        "tests/attention/test_triton_attention.py",
        "tests/attention/test_triton_engine_interpreted.py",
        "tests/batches/test_batch_lease_e2e.py",
        "tests/batches/test_batches_e2e.py",
        "tests/cli/test_gateway_cmd.py",
        "tests/embedding/test_embedding_fairness_e2e.py",
        "tests/engine/procs/test_data_parallel.py",
        "tests/engine/procs/test_engine_process.py",
        "tests/engine/procs/test_tensor_parallel.py",
        "tests/engine/test_engine_consistency.py",
        "tests/engine/test_overlap_schedule.py",
        "tests/engine/test_scheduler.py",
        "tests/grammar/test_grammar.py",
        "tests/grammar/test_strict_tools_e2e.py",
        "tests/grammar/test_structural_tag.py",
        "tests/hub/test_hub_serve_e2e.py",
        "tests/kvcache/test_kv_cache_dtype.py",
        "tests/kvcache/test_window_pages_engine.py",
        "tests/kvtiers/test_tenant_cache_e2e.py",
        "tests/kvtiers/test_tier_engine.py",
        "tests/kvtiers/test_tier_server_e2e.py",
        "tests/lora/test_lora_server.py",
        "tests/lora/test_lora_tp.py",
        "tests/lora/test_lora_vision.py",
        "tests/model/breadth/test_breadth_gguf.py",
        "tests/model/breadth/test_breadth_serve.py",
        "tests/model/breadth/test_breadth_tp.py",
        "tests/model/breadth/test_glm_minimax.py",
        "tests/model/breadth/test_llama4.py",
        "tests/model/breadth/test_mistral_phi3.py",
        "tests/model/breadth/test_smollm3_olmo_granite.py",
        "tests/model/moe/test_deepseek_v3.py",
        "tests/model/moe/test_gpt_oss.py",
        "tests/model/moe/test_moe_gguf.py",
        "tests/model/moe/test_moe_serve_e2e.py",
        "tests/model/moe/test_moe_tensor_parallel.py",
        "tests/model/quant/test_int4_triton.py",
        "tests/model/test_decode_kernel_count.py",
        "tests/model/test_gemma4.py",
        "tests/model/test_gemma4_serve.py",
        "tests/model/test_hybrid_triton.py",
        "tests/model/test_model_configs_bad_input.py",
        "tests/model/test_qwen3_5.py",
        "tests/model/test_qwen3_5_vl.py",
        "tests/model/test_reference_transformers.py",
        "tests/model/test_transformers_fallback.py",
        "tests/model/test_triton_gemv.py",
        "tests/multimodal/test_vision_server.py",
        "tests/ollama/test_ollama_client.py",
        "tests/ollama/test_ollama_images.py",
        "tests/plugins/test_plugins.py",
        "tests/server/reliability/test_connection_limits_e2e.py",
        "tests/server/reliability/test_faults_e2e.py",
        "tests/server/reliability/test_health_stall.py",
        "tests/server/reliability/test_server_limits.py",
        "tests/server/reliability/test_shutdown_e2e.py",
        "tests/server/test_anthropic_api.py",
        "tests/server/test_gateway_e2e.py",
        "tests/server/test_gateway_register_e2e.py",
        "tests/server/test_native_endpoints.py",
        "tests/server/test_ownership_e2e.py",
        "tests/server/test_responses_api.py",
        "tests/server/test_seed_notebooks.py",
        "tests/server/test_zero_token_prompts.py",
        "tests/server/web/test_web_ui.py",
        "tests/speculative/test_eagle.py",
        "tests/speculative/test_eagle3.py",
        "tests/speculative/test_mtp.py",
        "tests/speculative/test_speculative_engine.py",
        "tests/speculative/test_speculative_images.py",
        "tests/speculative/test_speculative_procs.py",
        "tests/speculative/test_speculative_serve.py",
    }
)


def pytest_collection_modifyitems(config, items):
    from pathlib import Path

    missing = [m for m in SLOW_MODULES if not (Path(config.rootpath) / m).exists()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py SLOW_MODULES names modules that are gone: {missing}")
    for item in items:
        if item.nodeid.split("::")[0] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random-weight Llama (seeded) saved as safetensors with the embedded tokenizer."""
    from model_utils import copy_embedded_tokenizer, save_tiny_model

    d = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("llama", d)
    copy_embedded_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def fake_server():
    from fake_engine import fake_app

    return InProcessServer(fake_app())


@pytest.fixture(scope="session")
def server():
    """The default configuration: embedded model at its GGUF precision (int4/int8 kernels), radix
    cache, torch attention."""
    yield from _server([])


@pytest.fixture(scope="session")
def dense_server():
    """The embedded GGUF dequantized to fp32 (``--quantization none``)."""
    yield from _server(["--quantization", "none", "--batch-storage", "none"])


@pytest.fixture(scope="session")
def det_server():
    """Batch-invariant numerics, for 'alone equals batched' checks."""
    yield from _server(["--enable-deterministic-inference"])


# -- GPU tests, each in its own process ---------------------------------------------------------
# After a CUDA fault (an illegal address, a device-side assert) every later CUDA call in the process
# fails, so one broken kernel used to fail every GPU test after it. Each test marked ``gpu`` runs in
# a fresh pytest process of its own (CUDA_LAUNCH_BLOCKING=1, so a fault names its kernel); the
# parent reports that process's outcome. LLMKIT_GPU_TEST_CHILD marks the child; setting it by hand
# runs GPU tests in-process (a debugger).
GPU_CHILD_ENV = "LLMKIT_GPU_TEST_CHILD"
GPU_TEST_TIMEOUT = 900


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    import os
    import subprocess
    import sys

    if pyfuncitem.get_closest_marker("gpu") is None or os.environ.get(GPU_CHILD_ENV) == "1":
        return None
    env = {**os.environ, GPU_CHILD_ENV: "1", "CUDA_LAUNCH_BLOCKING": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", pyfuncitem.nodeid]
    try:
        proc = subprocess.run(
            cmd, cwd=pyfuncitem.config.rootpath, env=env, capture_output=True, text=True, timeout=GPU_TEST_TIMEOUT
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{pyfuncitem.nodeid}: no result in its own process within {GPU_TEST_TIMEOUT} s")
    out = proc.stdout[-6000:] + proc.stderr[-3000:]
    if proc.returncode == 0 and " skipped" in proc.stdout and " passed" not in proc.stdout:
        reasons = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
        pytest.skip(reasons[0] if reasons else "skipped in its own process")
    if proc.returncode != 0:
        pytest.fail(f"{pyfuncitem.nodeid} failed in its own process:\n{out}", pytrace=False)
    return True
