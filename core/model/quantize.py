"""The walks over a model's layers that loading and ``--quantization`` need: pack each linear layer
once loading is done, convert layers and experts to a weight format, count the weights' bytes.

They live here, not in the model contract (``causal_lm.py``), because they must know the layer
types (``linear``, ``moe``) and the format table (``quant.weight_formats``). After a walk that
changes the weights the model's :meth:`CausalLM.weights_changed` hook runs, so a model plugin can
derive (or drop) what it computes from them.
"""

from __future__ import annotations

from torch import nn

from llmkit.core.model.linear import Linear, LMHead, VocabEmbedding
from llmkit.core.model.moe import FusedExperts
from llmkit.core.model.quant.weight_formats import weight_format


def release_free_heap() -> None:
    """Hand the heap that loading freed (staging buffers, dequantized transients) back to the OS;
    glibc keeps it otherwise, and the resident size of a quantized model would show it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _changed(model: nn.Module) -> None:
    hook = getattr(model, "weights_changed", None)  # a model plugin need not derive CausalLM
    if hook is not None:
        hook()


def finalize_weights(model: nn.Module) -> None:
    """Let every linear layer pack its weight once loading is done."""
    for module in list(model.modules()):
        if isinstance(module, Linear):
            module.finalize()
    _changed(model)
    release_free_heap()


def quantize(model: nn.Module, method: str, group_size: int | None = None) -> None:
    """Convert the dense weights of every linear layer, the LM head and the MoE experts to the weight format ``method`` names; experts already quantized
    (at load, see :func:`quantize_experts`) stay as they are."""
    fmt = weight_format(method, group_size)
    hidden_size = int(model.config["hidden_size"])  # the LM head's input features
    for module in list(model.modules()):
        if isinstance(module, Linear):
            module.set_format(fmt.for_features(module.local_in))
        elif isinstance(module, LMHead):
            module.set_format(fmt.for_features(hidden_size))
        elif isinstance(module, FusedExperts):
            module.set_format(fmt, filled=True)  # (loaded, or dummy weights)
    _changed(model)
    release_free_heap()


def quantize_experts(model: nn.Module, method: str, group_size: int | None = None) -> None:
    """Before loading: give the MoE experts the format ``method`` names, so each expert is
    quantized as its tensors arrive and the experts' fp32 weights are never resident at once."""
    fmt = weight_format(method, group_size)
    for module in model.modules():
        if isinstance(module, FusedExperts):
            module.set_format(fmt)


def weight_bytes(model: nn.Module) -> int:
    """Bytes the loaded weights hold, quantized buffers included (they are not persistent, so
    ``state_dict()`` misses them, as it misses the layers kept in plain lists: a quantized
    embedding table or LM head, quantized experts). Each storage counted once."""
    tensors = [*model.parameters(), *model.buffers()]
    for m in model.modules():
        if isinstance(m, FusedExperts):
            tensors += m.weight_tensors().values()
        extra = m.qtable if isinstance(m, VocabEmbedding) else m.fmt_layer if isinstance(m, LMHead) else None
        if isinstance(extra, Linear):
            tensors += [*extra.parameters(), *extra.buffers()]
    seen = {}
    for t in tensors:
        if t is not None and t.numel():
            s = t.untyped_storage()
            seen[(s.data_ptr(), t.device)] = s.nbytes()
    return sum(seen.values())
