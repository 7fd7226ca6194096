"""BERT (``BertModel``): the encoder behind sentence-transformers' MiniLM, BGE and E5 models, and
XLM-RoBERTa (``XLMRobertaModel``, bge-m3's), plus their ``*ForSequenceClassification`` heads:
the cross-encoders behind /v1/rerank and /v1/score (bge-reranker, ms-marco MiniLM).

Post-LN transformer: word + position + token-type embeddings, then per layer self-attention and a
GELU feed-forward, each followed by a residual add and LayerNorm. A batch's inputs are packed
end to end, so the linear layers (nearly all the work) never compute padding; only attention
pads them to the longest, with a key-padding mask. RoBERTa differs only in its positions, which
start after ``pad_token_id`` (``padding_idx + 1``), and its single token type.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from llmkit.core.model.encoder import Encoder, Scorer
from llmkit.core.model.loader.source import iter_safetensors

_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
# the same activations as oneDNN post-ops: (post-op, its algorithm)
_POST_OPS = {"gelu": ("gelu", "none"), "gelu_new": ("gelu", "tanh"), "relu": ("relu", "")}
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class _Dense:
    """``act(x @ weight.T + bias)``. On CPU in fp32, for fewer than 256 rows (a few sentences),
    through oneDNN with the weight reordered once into its blocked layout and the activation fused
    into the GEMM, as the generation path's Linear prefers oneDNN there; ``F.linear`` otherwise
    (MKL, a little faster on the long row counts of a big batch)."""

    ONEDNN_ROWS = 256

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, act: str | None = None) -> None:
        self.act, self.weight, self.bias = act, weight, bias
        onednn = _ONEDNN and weight.device.type == "cpu" and weight.dtype == torch.float32
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64) if onednn else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] < self.ONEDNN_ROWS:
            op, algorithm = _POST_OPS[self.act] if self.act else ("none", "")
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, op, [], algorithm)
        y = F.linear(x, self.weight, self.bias)
        return _ACTIVATIONS[self.act](y) if self.act else y


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, inter: int, eps: float, act: str) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = (
            nn.Linear(hidden, hidden),
            nn.Linear(hidden, hidden),
            nn.Linear(hidden, hidden),
        )
        self.attn_out, self.attn_norm = nn.Linear(hidden, hidden), nn.LayerNorm(hidden, eps=eps)
        self.up, self.down = nn.Linear(hidden, inter), nn.Linear(inter, hidden)
        self.ffn_norm = nn.LayerNorm(hidden, eps=eps)
        self.act = act
        self.dense: dict[str, _Dense] = {}  # built by fuse()

    def fuse(self) -> None:
        """Once the weights are loaded and moved: Q, K and V stacked into one GEMM, and each GEMM
        in the form its device runs fastest (see :class:`_Dense`)."""
        self.dense = {
            "qkv": _Dense(
                torch.cat([self.query.weight, self.key.weight, self.value.weight]),
                torch.cat([self.query.bias, self.key.bias, self.value.bias]),
            ),
            "out": _Dense(self.attn_out.weight, self.attn_out.bias),
            "up": _Dense(self.up.weight, self.up.bias, self.act),
            "down": _Dense(self.down.weight, self.down.bias),
        }

    def forward(self, x: torch.Tensor, pack: "_Packing") -> torch.Tensor:
        """``x``: the batch's real tokens, packed ``[tokens, hidden]``. The linear layers see no
        padding; attention alone runs padded."""
        d = self.dense
        x = self.attn_norm(x + d["out"](pack.attend(d["qkv"](x), self.heads)))
        return self.ffn_norm(x + d["down"](d["up"](x)))


class _Packing:
    """Where each input's tokens sit in the packed ``[tokens, ...]`` layout the linear layers use
    and in the padded ``[inputs * longest, ...]`` one attention needs (a padded slot reads a zero
    row and is masked out as a key). One padded run: per-run SDPA calls cost more than they save."""

    def __init__(self, lengths: list[int], device: torch.device) -> None:
        self.rows, self.longest = len(lengths), max(lengths)
        n = torch.tensor(lengths)
        keep = torch.arange(self.longest)[None, :] < n[:, None]  # [rows, longest]
        self.total = int(n.sum())
        self.mask = self.slot = self.real = None
        if self.total < self.rows * self.longest:
            slot = torch.full(keep.shape, self.total, dtype=torch.long)
            slot[keep] = torch.arange(self.total)
            self.slot = slot.view(-1).to(device)
            self.real = keep.view(-1).nonzero().squeeze(1).to(device)
            self.mask = keep[:, None, None, :].to(device)

    def attend(self, qkv: torch.Tensor, heads: int) -> torch.Tensor:
        """Attention over packed ``[tokens, 3 * hidden]`` Q, K, V; the output packed ``[tokens, hidden]``."""
        h = qkv.shape[1] // 3
        if self.slot is not None:
            qkv = torch.cat([qkv, qkv.new_zeros(1, 3 * h)]).index_select(0, self.slot)
        q, k, v = qkv.view(self.rows, self.longest, 3, heads, h // heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask).transpose(1, 2).reshape(-1, h)
        return out if self.real is None else out.index_select(0, self.real)


# checkpoint name (after the layer prefix) -> our parameter name
_LAYER_NAMES = {
    "attention.self.query": "query",
    "attention.self.key": "key",
    "attention.self.value": "value",
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "up",
    "output.dense": "down",
    "output.LayerNorm": "ffn_norm",
}


class BertModel(nn.Module, Encoder):
    #: checkpoint prefixes a task model nests the encoder under
    prefixes = ("bert.",)

    def __init__(self, config: dict) -> None:
        super().__init__()
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"BERT with {config['position_embedding_type']} position embeddings is not supported")
        act = config.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"BERT hidden_act '{act}' is not supported; supported: {', '.join(_ACTIVATIONS)}")
        hidden, eps = config["hidden_size"], config.get("layer_norm_eps", 1e-12)
        self.hidden_size = hidden
        self.pad_id = config.get("pad_token_id") or 0
        # RoBERTa numbers positions from padding_idx + 1 (position ids at or below are padding's)
        self.position_offset = self.pad_id + 1 if config.get("model_type") in ("roberta", "xlm-roberta") else 0
        self.max_position = config["max_position_embeddings"] - self.position_offset
        self.word = nn.Embedding(config["vocab_size"], hidden)
        self.position = nn.Embedding(config["max_position_embeddings"], hidden)
        self.token_type = nn.Embedding(config.get("type_vocab_size", 2), hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(
            _Layer(hidden, config["num_attention_heads"], config["intermediate_size"], eps, act)
            for _ in range(config["num_hidden_layers"])
        )

    @classmethod
    def from_pretrained(cls, model_dir: Path, config: dict, device: torch.device, dtype: torch.dtype) -> "BertModel":
        with torch.device("meta"):
            model = cls(config)
        model.load_weights(iter_safetensors(model_dir))
        model = model.to(device=device, dtype=dtype).eval()
        for layer in model.layers:
            layer.fuse()
        return model

    def load_weights(self, weights) -> None:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            ours = _our_name(name, self.prefixes)
            if ours is None:
                continue  # the pooler head and position_ids buffers: not used for embeddings
            if ours not in params:
                raise ValueError(f"unexpected BERT weight '{name}'")
            if tuple(tensor.shape) != tuple(params[ours].shape):
                raise ValueError(
                    f"BERT weight '{name}' has shape {tuple(tensor.shape)}, not {tuple(params[ours].shape)}"
                )
            module_name, _, attr = ours.rpartition(".")
            setattr(self.get_submodule(module_name), attr, nn.Parameter(tensor.float(), requires_grad=False))
            loaded.add(ours)
        missing = sorted(params.keys() - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks BERT weights: {', '.join(missing[:5])}")

    @torch.inference_mode()
    def encode(self, inputs: list[list[int]]) -> list[torch.Tensor]:
        return list(self.hidden(inputs).float().split([len(row) for row in inputs]))

    def hidden(self, inputs: list[list[int]], type_ids: list[list[int]] | None = None) -> torch.Tensor:
        """The last hidden states of the batch's tokens, packed end to end: ``[tokens, hidden]``."""
        device = self.word.weight.device
        lengths = [len(ids) for ids in inputs]
        ids = torch.tensor([t for row in inputs for t in row], dtype=torch.long, device=device)
        positions = (torch.cat([torch.arange(n) for n in lengths]) + self.position_offset).to(device)
        if type_ids is None:
            types = self.token_type.weight[0]
        else:
            types = self.token_type(torch.tensor([t for row in type_ids for t in row], dtype=torch.long, device=device))
        x = self.embed_norm(self.word(ids) + self.position(positions) + types)
        pack = _Packing(lengths, device)
        for layer in self.layers:
            x = layer(x, pack)
        return x


class XLMRobertaModel(BertModel):
    prefixes = ("roberta.",)


class BertForSequenceClassification(nn.Module, Scorer):
    """A cross-encoder: the encoder, then on the first ([CLS]) token a dense layer with tanh (BERT's
    pooler) and a one-label classifier whose logit is the pair's relevance. The routes apply the
    activation sentence-transformers' ``CrossEncoder`` and vLLM apply by default: sigmoid, unless
    config.json names another (``sentence_transformers.activation_fn``)."""

    encoder_cls = BertModel
    # checkpoint names of the head's dense layer and classifier (RoBERTa's head is one module)
    head_names = {"bert.pooler.dense": "dense", "classifier": "out"}

    def __init__(self, config: dict) -> None:
        super().__init__()
        labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
        if labels != 1:
            raise ValueError(f"a cross-encoder for rerank and score has one label; this classifier has {labels}")
        self.encoder = self.encoder_cls(config)
        self.max_position = self.encoder.max_position
        self.activation = _activation(config)
        hidden = config["hidden_size"]
        self.dense, self.out = nn.Linear(hidden, hidden), nn.Linear(hidden, 1)

    @classmethod
    def from_pretrained(cls, model_dir: Path, config: dict, device: torch.device, dtype: torch.dtype):
        with torch.device("meta"):
            model = cls(config)
        model.load_weights(iter_safetensors(model_dir))
        model = model.to(device=device, dtype=dtype).eval()
        for layer in model.encoder.layers:
            layer.fuse()
        return model

    def load_weights(self, weights) -> None:
        head = {}

        def encoder_weights():
            for name, tensor in weights:
                module, _, attr = name.rpartition(".")
                if module in self.head_names:
                    head[f"{self.head_names[module]}.{attr}"] = tensor
                else:
                    yield name, tensor

        self.encoder.load_weights(encoder_weights())
        params = dict(self.dense.named_parameters(prefix="dense")) | dict(self.out.named_parameters(prefix="out"))
        if head.keys() != params.keys():
            raise ValueError(f"the checkpoint's classifier head has {sorted(head)}, not {sorted(params)}")
        for name, tensor in head.items():
            module, attr = name.split(".")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(
                    f"classifier weight '{name}' has shape {tuple(tensor.shape)}, not {tuple(params[name].shape)}"
                )
            setattr(getattr(self, module), attr, nn.Parameter(tensor.float(), requires_grad=False))

    @torch.inference_mode()
    def score(self, inputs: list[list[int]], type_ids: list[list[int]] | None = None) -> list[float]:
        starts = [0]
        for row in inputs[:-1]:
            starts.append(starts[-1] + len(row))
        states = self.encoder.hidden(inputs, type_ids)
        first = states[torch.tensor(starts, device=states.device)]  # each input's [CLS]
        return self.out(torch.tanh(self.dense(first)))[:, 0].float().tolist()


class XLMRobertaForSequenceClassification(BertForSequenceClassification):
    encoder_cls = XLMRobertaModel
    head_names = {"classifier.dense": "dense", "classifier.out_proj": "out"}


def _activation(config: dict) -> str:
    """sentence-transformers' activation for the logit, as saved in config.json (v3+ under
    ``sentence_transformers``, older as ``sbert_ce_default_activation_function``); sigmoid without."""
    name = (config.get("sentence_transformers") or {}).get("activation_fn")
    name = name or config.get("sbert_ce_default_activation_function") or "Sigmoid"
    short = name.rsplit(".", 1)[-1]
    if short not in ("Sigmoid", "Identity"):
        raise ValueError(f"cross-encoder activation '{name}' is not supported; Sigmoid and Identity are")
    return short.lower()


def _our_name(name: str, prefixes: tuple[str, ...]) -> str | None:
    for prefix in prefixes:  # task checkpoints (BertForMaskedLM, *ForSequenceClassification) nest the encoder
        name = name.removeprefix(prefix)
    if name.startswith("embeddings."):
        return {
            "embeddings.word_embeddings.weight": "word.weight",
            "embeddings.position_embeddings.weight": "position.weight",
            "embeddings.token_type_embeddings.weight": "token_type.weight",
            "embeddings.LayerNorm.weight": "embed_norm.weight",
            "embeddings.LayerNorm.bias": "embed_norm.bias",
        }.get(name)
    if not name.startswith("encoder.layer."):
        return None
    index, _, rest = name.removeprefix("encoder.layer.").partition(".")
    module, _, attr = rest.rpartition(".")
    if module not in _LAYER_NAMES:
        return None
    return f"layers.{index}.{_LAYER_NAMES[module]}.{attr}"
