"""The plugin authors' attention kit (llmkit.testing.attention) on llmkit's own backends.

``torch`` runs the kit's cases as registered and with its C kernel turned off (its padded-GEMM
path against the C kernel's, where that builds); ``triton`` runs them under Triton's interpreter,
in fresh subprocesses as tests/attention/test_triton_attention.py explains. Two broken backends
show that the check fails: one off by a little in its outputs, one that forgets to store K.
"""

from __future__ import annotations

import os

import pytest
import torch

from llmkit.core.plugins import registry
from llmkit.testing.attention import CASES, AttentionBackendContract, check_against_reference, reference_backend

from attention_utils import report_runs, run_in_subprocesses


class TestTorchBackend(AttentionBackendContract):
    @pytest.fixture
    def backend_class(self):
        return registry().attention_backend("torch")


class TestTorchBackendWithoutItsCKernel(AttentionBackendContract):
    @pytest.fixture
    def backend_class(self):
        return registry().attention_backend("torch")

    @pytest.fixture
    def configure(self):
        return lambda backend: setattr(backend, "_native", False)


def test_the_reference_is_the_registered_torch_backend():
    from llmkit.plugins.attention.torch_backend import TorchAttentionBackend

    assert reference_backend() is TorchAttentionBackend


def test_the_check_fails_a_backend_off_by_a_little():
    class OffByALittle(reference_backend()):
        def forward(self, q, k, v, layer_id, metadata, **options):
            return super().forward(q, k, v, layer_id, metadata, **options) + 1e-3

    with pytest.raises(AssertionError, match=r"decode \(OffByALittle, float32\): outputs differ .* by up to 0.001"):
        check_against_reference(OffByALittle, next(c for c in CASES if c.name == "decode"))


def test_the_check_fails_a_backend_that_does_not_store_k():
    class ForgetsK(reference_backend()):
        def forward(self, q, k, v, layer_id, metadata, **options):
            out = super().forward(q, k, v, layer_id, metadata, **options)
            self.pool.k_buffers[layer_id][metadata.out_slots] = 0
            return out

    with pytest.raises(AssertionError, match=r"prefill \(ForgetsK, float32\): the new K are not in the pool"):
        check_against_reference(ForgetsK, CASES[0])


def _check_triton(run: str) -> None:
    case = next(c for c in CASES if c.name == run)
    # four split-K chunks, as test_triton_attention pins: the short contexts here span several
    check_against_reference(
        registry().attention_backend("triton"), case, configure=lambda b: setattr(b, "max_kv_splits", 4)
    )


def _main(runs: list[str]) -> None:
    """Subprocess entry (under the interpreter): the kit's cases on the triton backend."""
    report_runs(runs, _check_triton)


@pytest.fixture(scope="module")
def triton_results() -> dict[str, str]:
    pytest.importorskip("triton")
    names = [c.name for c in CASES]
    env = {**os.environ, "TRITON_INTERPRET": "1", "LLMKIT_TRITON_INTERPRET": "1"}
    return run_in_subprocesses("test_backend_kit", "_main", [names[0::2], names[1::2]], env)  # two cores


@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_triton_in_the_interpreter_matches_the_reference(case: str, triton_results: dict[str, str]) -> None:
    assert triton_results[case] == "ok", triton_results[case]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
class TestTritonCompiledOnCUDA(AttentionBackendContract):
    @pytest.fixture
    def backend_class(self):
        return registry().attention_backend("triton")

    @pytest.fixture
    def device(self):
        return "cuda"

    @pytest.fixture(params=[torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
    def dtype(self, request):
        return request.param
