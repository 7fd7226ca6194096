"""``--speculative-algorithm STANDALONE``: a smaller model with the same tokenizer drafts greedily
(``--speculative-draft-model-path``), SGLang's and vLLM's draft-model speculation.

The draft model is one of the project's own causal-LM plugins, run on the target's device and
dtype with a K/V cache of its own per request: contiguous buffers, grown by doubling, no pages
(a draft keeps a few thousand tokens per request at most). Each step re-syncs that cache to the
request's tokens (drafts the target rejected are cut off), feeds what it has not seen, then
decodes ``max_tokens`` greedy tokens one forward at a time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from llmkit.core.embedding.decoder import DenseCausalAttention
from llmkit.core.model.causal_lm import ForwardContext
from llmkit.core.speculative.contract import Proposer

log = logging.getLogger("llmkit")


@dataclass
class _DraftKV:
    """One request's draft K/V: per layer ``[capacity, kv_heads, head_dim]`` buffers, the first
    ``length`` rows valid; ``ids`` are the tokens they hold."""

    ids: list[int] = field(default_factory=list)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    length: int = 0
    deterministic: bool = False  # read by ForwardContext

    def cut(self, n: int) -> None:
        self.length = min(self.length, n)
        del self.ids[n:]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this forward's K/V rows after the valid ones; all valid rows of the layer."""
        end = self.length + k.shape[0]
        buf_k, buf_v = self.keys.get(layer), self.values.get(layer)
        if buf_k is None or buf_k.shape[0] < end:
            cap = max(64, 2 * end)
            new_k, new_v = k.new_empty(cap, *k.shape[1:]), v.new_empty(cap, *v.shape[1:])
            if buf_k is not None:
                new_k[: self.length], new_v[: self.length] = buf_k[: self.length], buf_v[: self.length]
            self.keys[layer], self.values[layer] = buf_k, buf_v = new_k, new_v
        buf_k[self.length : end], buf_v[self.length : end] = k, v
        return buf_k[:end], buf_v[:end]


class _DraftAttention(DenseCausalAttention):
    """The attention backend the draft model's layers call: causal attention of the new rows over
    the request's cached rows and themselves (no fast paths offered)."""

    def forward(self, q, k, v, layer_id, metadata: _DraftKV, *, sliding_window=None, sinks=None):
        keys, values = metadata.append(layer_id, k, v)
        n, total = q.shape[0], keys.shape[0]
        # query i sits at position total - n + i and sees every key up to it
        mask = torch.arange(total, device=q.device)[None, :] <= torch.arange(total - n, total, device=q.device)[:, None]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return out.transpose(0, 1)


class StandaloneProposer(Proposer):
    def __init__(
        self,
        draft_model_path: str | None = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        target_vocab_size: int | None = None,
        **options,
    ) -> None:
        super().__init__(**options)
        if not draft_model_path:
            raise ValueError("STANDALONE speculation needs --speculative-draft-model-path (a smaller model)")
        from llmkit.core.embedding.decoder import load_causal_lm
        from llmkit.core.model.loader.source import load_config

        path = Path(draft_model_path).expanduser()
        if not (path / "config.json").exists():
            raise ValueError(f"--speculative-draft-model-path {draft_model_path}: no config.json there")
        config = load_config(path)
        vocab = int(config["vocab_size"])
        if target_vocab_size is not None and vocab < target_vocab_size:
            # the target's tokens are the draft's inputs: each must have a row in its embedding
            raise ValueError(
                f"the draft model's vocabulary ({vocab}) is smaller than the target's ({target_vocab_size}): "
                "a draft model must share the target's tokenizer"
            )
        self.model = load_causal_lm(path, config, torch.device(device), dtype)
        self.attention = _DraftAttention(self.model.attention_scale)
        self.max_position = int(config.get("max_position_embeddings", 1 << 30))
        self.device = torch.device(device)
        log.info("STANDALONE draft model: %s (%s)", path, config.get("architectures", ["?"])[0])

    @torch.inference_mode()
    def propose(self, req, max_tokens: int) -> list[int]:
        ids = req.all_ids
        if len(ids) + max_tokens > self.max_position:
            return []
        kv = req.spec_state if isinstance(req.spec_state, _DraftKV) else _DraftKV()
        req.spec_state = kv
        same = 0  # the cached tokens the request still has (a rejected draft is cut off)
        for a, b in zip(kv.ids, ids):
            if a != b:
                break
            same += 1
        kv.cut(min(same, len(ids) - 1))  # at least the last token is fed: its logits draft the first
        feed, draft = ids[kv.length :], []
        for _ in range(max_tokens):
            positions = torch.arange(kv.length, kv.length + len(feed), device=self.device)
            states = self.model(
                torch.tensor(feed, dtype=torch.long, device=self.device),
                positions,
                ForwardContext(self.attention, kv),
            )
            kv.length += len(feed)
            kv.ids.extend(feed)
            token = int(self.model.compute_logits(states[-1:]).argmax(dim=-1)[0])
            draft.append(token)
            feed = [token]
        return draft
