"""``--speculative-algorithm EAGLE``: an EAGLE-1/EAGLE-2 draft head (``--speculative-draft-model-path``,
the directory its repository ships: a one-layer Llama ``config.json`` and the weights).

The head is ``fc`` over ``[embed(token), feature]`` (twice the hidden width, with a bias) and one
Llama decoder layer without its input norm; the target's LM head reads its output directly. Its first
feature is the target's output state (after the final norm) at the position before the token, then
its own output for each further draft token, as the EAGLE repository and SGLang run it. The
embedding is the target's unless the checkpoint carries its own. The bookkeeping (the states kept
per request, the head's K/V cut back to the target's tokens) is
:class:`~llmkit.plugins.speculative.hidden_draft.HiddenStateProposer`'s.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from llmkit.core.multimodal.items import image_token_of
from llmkit.plugins.speculative.draft_cache import DraftKV
from llmkit.plugins.speculative.head_files import head_config, load_tensors, place, shared_embedding
from llmkit.plugins.speculative.head_layer import HeadLayer, layer_names
from llmkit.plugins.speculative.hidden_draft import HiddenStateProposer

log = logging.getLogger("llmkit")


class EagleHead(nn.Module):
    def __init__(self, config: dict, target, embed: nn.Module, target_vocab=None) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        # the target's LM head (rank 0's gathered copy under tensor parallelism) and embedding:
        # shared, not submodules
        logits = target_vocab.logits if target_vocab is not None else target.compute_logits
        self._shared = (logits, embed)
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.layer = HeadLayer(config, hidden)

    def forward(self, hidden, tokens, positions, kv: DraftKV) -> torch.Tensor:
        embed = self._shared[1]
        x = self.fc(torch.cat((embed(tokens), hidden), dim=-1))
        return self.layer(x, x, positions, kv)  # (no input norm: x is the attention's input as it is)

    def scores(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary for output rows ``out``."""
        return self._shared[0](out)


_NAMES = {"fc.weight": "fc.weight", "fc.bias": "fc.bias", **layer_names("layers.0.", "layer.")}
# shipped by some heads and unused by the layer (EAGLE's first layer has no input norm)
_IGNORED = {"layers.0.input_layernorm.weight", "norm.weight", "lm_head.weight"}


class EagleProposer(HiddenStateProposer):
    reads_target_vocab = True

    def __init__(
        self,
        draft_model_path: str | None = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        target_model=None,
        target_vocab=None,
        **options,
    ) -> None:
        super().__init__(**options)
        path, config = head_config(draft_model_path, "EAGLE", "the EAGLE head's directory", target_model)
        if int(config.get("hidden_size", -1)) != int(target_model.config["hidden_size"]):
            raise ValueError("EAGLE head: its hidden size differs from the target's")
        tensors = load_tensors(path, "EAGLE")
        self.device = torch.device(device)
        embed = shared_embedding(target_model, tensors, self.device, dtype, "EAGLE", target_vocab)
        self.target = target_model
        self.head = EagleHead(config, target_model, embed, target_vocab)
        place(self.head, tensors, _NAMES, _IGNORED, "EAGLE", "an EAGLE-1/2")
        self.head.to(device=self.device, dtype=dtype).eval()
        self.feature_layers = (target_model.num_layers,)  # the last layer's output, normed below
        self.max_position = int(config.get("max_position_embeddings", 1 << 30))
        self.image_token = image_token_of(target_model.config)
        log.info("EAGLE draft head: %s", path)

    def draft_layer(self, hidden, tokens, positions, kv, from_target: bool):
        if from_target:  # the captured state is the last layer's output before the final norm
            hidden = self.target.norm(hidden)
        return self.head(hidden, tokens, positions, kv)

    def draft_scores(self, out):
        return self.head.scores(out)
