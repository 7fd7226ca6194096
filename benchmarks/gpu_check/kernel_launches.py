"""The kernels a decode step of the CUDA path launches, counted on the CPU (``count_kernels.py --cpu``).

The model runs the forms it runs on CUDA: the fused Triton kernels (in Triton's interpreter, which
``CPU_ENV`` selects before anything imports Triton) and the Triton attention backend, with the C
kernels off (``LLMKIT_NATIVE=0``), so every other op is the torch op a GPU runs.
A torch dispatch mode sees each aten op; those that launch a kernel on a GPU (not views, metadata or
allocations) are counted with each Triton launch, per decoder layer and outside the layers (the
embedding, the rotary table, the final norm and the LM head). A library's own extra kernels inside
one op (cuBLAS's split-K reduce after a small GEMM) are not visible here.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

# The CUDA path's forms on the CPU: Triton's interpreter (chosen when triton is imported) and the C
# kernels off (LLMKIT_NATIVE is read when llmkit's native module is imported).
CPU_ENV = {"LLMKIT_TRITON_INTERPRET": "1", "TRITON_INTERPRET": "1", "LLMKIT_NATIVE": "0"}
# aten ops that launch nothing on a GPU: views and other metadata, and allocations.
NO_KERNEL = frozenset(
    """view _unsafe_view reshape _reshape_alias as_strided slice select split split_with_sizes unbind narrow
    t transpose permute expand unsqueeze squeeze detach alias empty empty_strided empty_like new_empty
    lift_fresh set_ resize_""".split()
)
# a matrix product, whatever the CPU's dispatch names it (oneDNN's linear, for one)
GEMM = frozenset({"mm", "addmm", "bmm", "matmul", "linear", "_linear_pointwise"})
SYNC = "_local_scalar_dense"  # .item(): a device-to-host copy the host waits for


def count_on_cpu(preset: str, steps: int) -> dict:
    """Launches of the last of ``steps`` decode steps of one request (greedy, 8 prompt tokens).
    Call it before this process imports triton or llmkit."""
    assert "triton" not in sys.modules and "llmkit" not in sys.modules, "CPU_ENV must apply at their import"
    os.environ.update(CPU_ENV)
    import triton.runtime.interpreter as interpreter
    from torch.utils._python_dispatch import TorchDispatchMode

    sys.path.insert(0, str(HERE.parent))
    from gpu_presets import write_model_dir

    from llmkit.core.engine.builder import build_engine_parts
    from llmkit.core.engine.config import EngineConfig
    from llmkit.core.engine.loop import Engine
    from llmkit.core.engine.messages import GenerateRequest, SamplingParams
    from llmkit.core.model import layers
    from llmkit.plugins.attention import triton_backend

    if layers.FUSED_ON_CUDA:  # the choice CUDA tensors get, for CPU tensors too
        from llmkit.core.model import triton_pointwise

        layers._fused = lambda x: triton_pointwise
    else:  # what the backend does on CUDA with the fused kernels off: rotate, store and add apart
        triton_backend.TritonAttentionBackend.forward_qkv = lambda self, *a, **k: None
    if layers.GEMV_ON_CUDA:  # (LLMKIT_TRITON_GEMV=1) the decode GEMVs, for CPU tensors too
        from llmkit.core.model import triton_gemv

        layers.decode_gemv = lambda x: triton_gemv if x.shape[0] <= triton_gemv.MAX_ROWS else None

    where, paused, step = ["outside"], [0], {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            # ``to``/``contiguous`` that change nothing hand their input back: no kernel
            same = name in ("to", "contiguous") and args and out is args[0]
            if not paused[0] and name not in NO_KERNEL and not same:
                step.setdefault(where[0], []).append("gemm" if name in GEMM else name)
            return out

    launch = interpreter.InterpretedFunction.run

    def counted_launch(self, *args, **kwargs):
        step.setdefault(where[0], []).append("triton:" + self.fn.__name__)
        paused[0] += 1  # the interpreter's own tensor traffic is not the kernel's
        try:
            return launch(self, *args, **kwargs)
        finally:
            paused[0] -= 1

    interpreter.InterpretedFunction.run = counted_launch

    d = Path(tempfile.mkdtemp())
    write_model_dir(preset, d)
    cfg = EngineConfig(
        model_path=str(d), load_format="dummy", device="cpu", attention="triton", disable_cuda_graph=True,
        grammar_backend="none", max_total_tokens=1024, max_running_requests=4, overlap_schedule=False,
    )  # fmt: skip
    parts = build_engine_parts(cfg)
    model = parts.model

    def in_layer(i, forward):
        def run(*args, **kwargs):
            where[0] = f"layer {i}"
            try:
                return forward(*args, **kwargs)
            finally:
                where[0] = "outside"

        return run

    for i, layer in enumerate(model.layers):
        layer.forward = in_layer(i, layer.forward)

    def counting(fn):
        def run(*args, **kwargs):
            with Count():
                return fn(*args, **kwargs)

        return run

    forward, logits = model.forward, model.compute_logits
    model.forward, model.compute_logits = counting(forward), counting(logits)
    engine = Engine(cfg, parts)
    params = SamplingParams(max_new_tokens=steps + 2, ignore_eos=True, temperature=0.0)
    engine.add(GenerateRequest("k", [5, 6, 7, 8, 9, 10, 11, 12], params), lambda o: None)
    for _ in range(steps + 1):  # the prefill, then the decode steps; ``step`` keeps the last one's
        step.clear()
        engine.step()
    last = step
    layer_ops = last[f"layer {len(model.layers) - 1}"]  # (the first layer has no residual to add yet)
    kernels = [op for ops in last.values() for op in ops]
    return {
        "kernels_per_step": sum(op != SYNC for op in kernels),
        "layers": len(model.layers),
        "per_layer": len(layer_ops),
        "layer_ops": layer_ops,
        "outside_ops": last.get("outside", []),
        "syncs": sum(op == SYNC for op in kernels),
    }
