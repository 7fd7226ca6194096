"""Causal LMs served as embedders (Qwen3-Embedding style: the last token's hidden state) and as
yes/no rerankers (Qwen3-Reranker style: P("yes") at the last position).

The model is the project's own plugin (``Qwen3ForCausalLM``, ``LlamaForCausalLM``...), run once
over whole inputs: a dense causal attention stands where the paged backend stands, so no KV cache
is kept. Inputs are concatenated without padding (ragged), each attending only to itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from llmkit.core.model import quantize
from llmkit.core.model.causal_lm import ForwardContext
from llmkit.core.model.encoder import Encoder, Scorer
from llmkit.core.model.loader.source import iter_safetensors
from llmkit.core.plugins import registry

# Qwen3-Reranker's prompt, from its model card: the judgement is the next token, "yes" or "no"
QWEN3_RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass
class _Ragged:
    """The metadata the dense attention reads: where each input starts in the flat batch."""

    starts: list[int]
    deterministic: bool = False


class DenseCausalAttention:
    """What a decoder layer asks of an attention backend, for whole inputs and no cache: causal
    attention within each input of the flat batch (no fast paths offered). A subclass with its
    own ``forward`` serves other layouts (the STANDALONE draft model's cache)."""

    def __init__(self, scale: float | None) -> None:
        self.scale = scale

    def forward_qkv(self, qkv, rope, layer_id, metadata):
        return None

    def native_attend(self, rope, metadata):
        return None

    def forward(self, q, k, v, layer_id, metadata: _Ragged, *, sliding_window=None, sinks=None):
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
        for a, b in zip(metadata.starts, metadata.starts[1:]):
            o = F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1),
                k[a:b].transpose(0, 1),
                v[a:b].transpose(0, 1),
                is_causal=True,
                scale=self.scale,
                enable_gqa=True,
            )
            out[a:b] = o.transpose(0, 1)
        return out


def causal_architecture(config: dict) -> str | None:
    """The causal-LM plugin for ``config``: its architecture where registered, else by model_type
    (a ``Qwen3Model`` checkpoint, saved without the LM head, runs on ``Qwen3ForCausalLM``)."""
    reg = registry()
    archs = config.get("architectures") or []
    if archs and archs[0] in reg.names("model"):
        name = archs[0]
    else:
        name = reg.architecture_for_model_type(config.get("model_type", ""))
    if name is None:
        return None
    meta = reg.entry("model", name).meta  # encoders and speech models are no causal LMs
    return None if meta.get("embedding") or meta.get("speech") else name


def load_causal_lm(model_dir: Path, config: dict, device: torch.device, dtype: torch.dtype):
    """The plugin's model with its checkpoint loaded, as the engine builds it (one rank, dense)."""
    model_cls = registry().model(causal_architecture(config))
    if model_cls.attention_features:
        raise ValueError(f"{model_cls.__name__} needs attention features the cache-free forward lacks")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(config).eval()
    finally:
        torch.set_default_dtype(prev)
    model.load_weights(iter_safetensors(model_dir))
    quantize.finalize_weights(model)
    return model


class _CausalForward:
    model: object
    attention: DenseCausalAttention

    def last_states(self, inputs: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """The final hidden states of the flat batch ``[T, hidden]`` and each input's start."""
        device = next(self.model.parameters()).device
        starts = [0]
        for row in inputs:
            starts.append(starts[-1] + len(row))
        ids = torch.tensor([t for row in inputs for t in row], dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(len(row)) for row in inputs]).to(device)
        return self.model(ids, positions, ForwardContext(self.attention, _Ragged(starts))), starts


class DecoderEncoder(_CausalForward, Encoder):
    """A causal LM as a bi-encoder: its final hidden states, pooled by the server (last token)."""

    def __init__(self, model) -> None:
        self.model = model
        self.attention = DenseCausalAttention(model.attention_scale)
        self.hidden_size = int(model.config["hidden_size"])
        self.max_position = int(model.config.get("max_position_embeddings", 4096))

    @classmethod
    def from_pretrained(cls, model_dir, config, device, dtype) -> "DecoderEncoder":
        # the LM head is never used: tied, it costs nothing and an embedding checkpoint saved
        # without one (Qwen3-Embedding's) loads
        return cls(load_causal_lm(model_dir, {**config, "tie_word_embeddings": True}, device, dtype))

    @torch.inference_mode()
    def encode(self, inputs: list[list[int]]) -> list[torch.Tensor]:
        x, starts = self.last_states(inputs)
        return [x[a:b].float() for a, b in zip(starts, starts[1:])]


class DecoderReranker(_CausalForward, Scorer):
    """A causal LM as a yes/no reranker: the formatted pair's next-token logits at the last
    position, ``logit("yes") - logit("no")``, whose sigmoid is the softmax over the two, P("yes")
    (the model card's score; vLLM serves the same as a converted one-label classifier)."""

    activation = "sigmoid"

    def __init__(self, model, yes_id: int, no_id: int) -> None:
        self.model = model
        self.attention = DenseCausalAttention(model.attention_scale)
        self.max_position = int(model.config.get("max_position_embeddings", 4096))
        self.yes_id, self.no_id = yes_id, no_id

    @classmethod
    def from_pretrained(cls, model_dir, config, device, dtype) -> "DecoderReranker":
        """The judgement tokens are "yes" and "no" (or config.json's ``classifier_from_token``,
        ``[no, yes]`` as vLLM's converted rerankers name them)."""
        from transformers import AutoTokenizer

        no, yes = config.get("classifier_from_token") or ("no", "yes")
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        ids = tok.convert_tokens_to_ids([yes, no])
        if tok.unk_token_id in ids or None in ids:
            raise ValueError(f"the tokenizer has no single token for '{yes}' and '{no}': not a yes/no reranker")
        return cls(load_causal_lm(model_dir, config, device, dtype), *ids)

    @torch.inference_mode()
    def score(self, inputs: list[list[int]], type_ids: list[list[int]] | None = None) -> list[float]:
        x, starts = self.last_states(inputs)
        logits = self.model.compute_logits(x[torch.tensor(starts[1:], device=x.device) - 1])
        return (logits[:, self.yes_id] - logits[:, self.no_id]).float().tolist()
