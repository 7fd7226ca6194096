"""``--speculative-algorithm EAGLE3``: EAGLE-3's draft head (``--speculative-draft-model-path``, the
directory its repository ships: ``config.json`` with ``LlamaForCausalLMEagle3``, and the weights).

The head is one Llama decoder layer whose attention reads ``[norm(embed(token)), norm(hidden)]``
(twice the hidden width). Its first input is ``fc`` of the target's hidden states at three layer
inputs, concatenated (the target's low, middle and high features; ``eagle_aux_hidden_state_layer_ids``
in the config's ``eagle_config`` names the layers, as SGLang reads it); each later draft step feeds
the head's own output back. It predicts over a smaller vocabulary (``draft_vocab_size``) mapped to
the target's by ``d2t`` (target id = draft id + d2t[draft id]). The embedding is the target's unless
the checkpoint carries its own.

The bookkeeping (the features kept per request, the head's K/V cut back to the target's tokens)
is :class:`~llmkit.plugins.speculative.hidden_draft.HiddenStateProposer`'s.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from llmkit.core.model.layers import RMSNorm
from llmkit.core.multimodal.items import image_token_of
from llmkit.plugins.speculative.draft_cache import DraftKV
from llmkit.plugins.speculative.head_files import head_config, load_tensors, place, shared_embedding
from llmkit.plugins.speculative.head_layer import HeadLayer, layer_names
from llmkit.plugins.speculative.hidden_draft import HiddenStateProposer

log = logging.getLogger("llmkit")


def aux_layers(head_config: dict, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs are the head's features: the configured layer outputs
    (``eagle_aux_hidden_state_layer_ids``; the output of layer ``i`` is the input of ``i + 1``), or
    SGLang's and vLLM's default, the inputs of layers 2, L/2 and L-3."""
    ids = (head_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(int(i) + 1 for i in ids)
    n = num_target_layers
    return (2, n // 2, n - 3)


class Eagle3Head(nn.Module):
    def __init__(self, config: dict, num_features: int, embed: nn.Module) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.draft_vocab = int(config.get("draft_vocab_size") or config["vocab_size"])
        # the target's embedding is shared, not a submodule (moving the head must not move it)
        self._embed = (embed,)
        self.fc = nn.Linear(num_features * int(config.get("target_hidden_size") or hidden), hidden, bias=False)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.layer = HeadLayer(config, 2 * hidden)
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, self.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.long), persistent=False)

    def forward(self, hidden, tokens, positions, kv: DraftKV) -> torch.Tensor:
        """One pass of the draft layer over ``tokens`` at ``positions`` (their rows appended to
        ``kv``); ``hidden``: the target's features (fc applies) or the head's own last output.
        Returns the output hidden states (the next step's input)."""
        if hidden.shape[-1] != self.fc.out_features:
            hidden = self.fc(hidden)
        x = torch.cat((self.input_layernorm(self._embed[0](tokens)), self.hidden_norm(hidden)), dim=-1)
        return self.layer(x, hidden, positions, kv)

    def scores(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the head's own vocabulary (:meth:`to_target` maps its ids)."""
        return self.lm_head(self.norm(out))


class Eagle3Proposer(HiddenStateProposer):
    reads_target_vocab = True  # (its embedding, where the head ships none)

    def __init__(
        self,
        draft_model_path: str | None = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        target_vocab_size: int | None = None,
        target_model=None,
        target_vocab=None,
        **options,
    ) -> None:
        super().__init__(**options)
        path, config = head_config(draft_model_path, "EAGLE3", "the EAGLE-3 head's directory", target_model)
        self.feature_layers = aux_layers(config, target_model.num_layers)
        if len(set(self.feature_layers)) != len(self.feature_layers) or not all(
            0 <= i <= target_model.num_layers for i in self.feature_layers
        ):
            raise ValueError(f"EAGLE3: feature layers {self.feature_layers} do not fit the target's layers")
        self.device = torch.device(device)
        tensors = load_tensors(path, "EAGLE3")
        embed = shared_embedding(target_model, tensors, self.device, dtype, "EAGLE3", target_vocab)
        self.head = Eagle3Head(config, len(self.feature_layers), embed)
        _load_head(self.head, tensors, target_vocab_size)
        self.head.to(device=self.device, dtype=dtype).eval()
        self.max_position = int(config.get("max_position_embeddings", 1 << 30))
        self.image_token = image_token_of(target_model.config)
        log.info("EAGLE3 draft head: %s, features of target layers %s", path, self.feature_layers)

    def draft_layer(self, hidden, tokens, positions, kv, from_target: bool):
        return self.head(hidden, tokens, positions, kv)

    def draft_scores(self, out):
        return self.head.scores(out)

    def to_target(self, ids):
        return ids + self.head.d2t[ids]


# checkpoint name -> the head's parameter (the published EAGLE-3 layout: one "midlayer")
_NAMES = {
    "fc.weight": "fc.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "midlayer.input_layernorm.weight": "input_layernorm.weight",
    "midlayer.hidden_norm.weight": "hidden_norm.weight",
    **layer_names("midlayer.", "layer."),
}


def _load_head(head: Eagle3Head, tensors: dict[str, torch.Tensor], target_vocab: int | None) -> None:
    place(head, tensors, _NAMES, {"d2t", "t2d"}, "EAGLE3", "an EAGLE-3")
    if "d2t" in tensors:
        d2t = tensors["d2t"].to(torch.long)
        if d2t.shape != (head.draft_vocab,):
            raise ValueError(f"EAGLE3 head: d2t has {tuple(d2t.shape)}, the draft vocabulary is {head.draft_vocab}")
        head.d2t = d2t
    elif target_vocab is not None and head.draft_vocab != target_vocab:
        raise ValueError("EAGLE3 head: a draft vocabulary smaller than the target's needs its d2t mapping")
    top = int((torch.arange(head.draft_vocab) + head.d2t).max())
    if target_vocab is not None and top >= target_vocab:
        raise ValueError(f"EAGLE3 head: d2t maps to token {top}, past the target's vocabulary ({target_vocab})")
