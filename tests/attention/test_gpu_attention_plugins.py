"""Registration and availability of the GPU attention plugins (triton, flashinfer), on CPU."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

import llmkit.plugins.attention as gpu_backends


def test_registration_module_imports_no_heavy_dependency():
    code = (
        "import sys, llmkit.plugins.attention; "
        "print([m for m in ('torch', 'triton', 'flashinfer') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_registers_triton_and_flashinfer_lazily():
    seen: dict[str, object] = {}
    gpu_backends.llmkit_register_attention_backends(register=lambda name, factory, **meta: seen.update({name: factory}))
    assert seen == {
        "torch": "llmkit.plugins.attention.torch_backend:TorchAttentionBackend",
        "triton": "llmkit.plugins.attention.triton_backend:TritonAttentionBackend",
        "flashinfer": "llmkit.plugins.attention.flashinfer_backend:FlashInferAttentionBackend",
    }


def test_triton_on_cpu_without_interpreter_names_the_cpu_backends(monkeypatch):
    from llmkit.plugins.attention.triton_backend import TritonAttentionBackend

    monkeypatch.delenv("LLMKIT_TRITON_INTERPRET", raising=False)
    reason = TritonAttentionBackend.availability(torch.device("cpu"))
    assert reason is not None and "torch" in reason and "LLMKIT_TRITON_INTERPRET=1" in reason


def test_triton_interpreter_opt_in_sets_triton_interpret(monkeypatch):
    from llmkit.plugins.attention import triton_backend

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    monkeypatch.setenv("LLMKIT_TRITON_INTERPRET", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # recorded, so teardown restores the original
    monkeypatch.delenv("TRITON_INTERPRET")
    # Only meaningful while the kernels are not yet imported in this process.
    if any(m in sys.modules for m in triton_backend._KERNEL_MODULES):
        pytest.skip("kernel modules already imported in this process")
    assert triton_backend.TritonAttentionBackend.availability(torch.device("cpu")) is None
    assert triton_backend.os.environ["TRITON_INTERPRET"] == "1"


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is installed")
def test_flashinfer_missing_names_the_extra():
    from llmkit.core.kvcache.kv_pool import KVCachePool
    from llmkit.plugins.attention.flashinfer_backend import FlashInferAttentionBackend

    reason = FlashInferAttentionBackend.availability(torch.device("cuda"))
    assert reason is not None and "pip install 'llmkit[flashinfer]'" in reason
    pool = KVCachePool(
        num_layers=1,
        num_pages=2,
        page_size=1,
        num_kv_heads=1,
        head_dim=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    # On CPU installing the package would not help: the device is what is named.
    with pytest.raises(RuntimeError, match="needs a CUDA device") as exc:
        FlashInferAttentionBackend(num_heads=1, num_kv_heads=1, head_dim=8, pool=pool, device=torch.device("cpu"))
    assert "pip install" not in str(exc.value)
