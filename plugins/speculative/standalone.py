"""``--speculative-algorithm STANDALONE``: a smaller model with the same tokenizer drafts greedily
(``--speculative-draft-model-path``), SGLang's and vLLM's draft-model speculation.

The draft model is one of the project's own causal-LM plugins, run on the target's device and
dtype (or on ``--speculative-draft-device``, in fp32 on a CPU) with a K/V cache of its own per
request: contiguous buffers, grown by doubling, no pages
(a draft keeps a few thousand tokens per request at most). Each step re-syncs that cache to the
request's tokens (drafts the target rejected are cut off), feeds what it has not seen, then
decodes ``max_tokens`` greedy tokens one forward at a time.

A request with images (a vision-language target) drafts too: the draft model reads each image's
tokens as the target's image placeholder token (the prompt as the chat template wrote it), so it
cannot see the picture, but the text around it, and answers that repeat it, still draft.
"""

from __future__ import annotations

import logging

import torch

from llmkit.core.model.causal_lm import ForwardContext
from llmkit.core.multimodal.items import as_placeholders, image_token_of
from llmkit.core.speculative.contract import Proposer
from llmkit.core.speculative.tree import DraftTree
from llmkit.plugins.speculative.draft_cache import DraftAttention, DraftKV
from llmkit.plugins.speculative.head_files import head_dir
from llmkit.plugins.speculative.tree_search import search_tree, top_k

log = logging.getLogger("llmkit")


class StandaloneProposer(Proposer):
    runs_on_any_device = True  # (its own weights and K/V; token ids in and out)
    drafts_trees = True

    def __init__(
        self,
        draft_model_path: str | None = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        target_vocab_size: int | None = None,
        target_model=None,
        **options,
    ) -> None:
        super().__init__(**options)
        from llmkit.core.embedding.decoder import load_causal_lm
        from llmkit.core.model.loader.source import load_config

        path = head_dir(draft_model_path, "STANDALONE", "a smaller model")
        config = load_config(path)
        vocab = int(config["vocab_size"])
        if target_vocab_size is not None and vocab < target_vocab_size:
            # the target's tokens are the draft's inputs: each must have a row in its embedding
            raise ValueError(
                f"the draft model's vocabulary ({vocab}) is smaller than the target's ({target_vocab_size}): "
                "a draft model must share the target's tokenizer"
            )
        self.model = load_causal_lm(path, config, torch.device(device), dtype)
        self.attention = DraftAttention(self.model.attention_scale)
        self.max_position = int(config.get("max_position_embeddings", 1 << 30))
        self.device = torch.device(device)
        self.image_token = image_token_of(getattr(target_model, "config", None) or {})
        log.info("STANDALONE draft model: %s (%s)", path, config.get("architectures", ["?"])[0])

    @torch.inference_mode()
    def propose(self, req, max_tokens: int) -> list[int] | DraftTree:
        ids = req.all_ids
        if req.mm is not None:  # an image's pseudo-ids have no row in the draft's embedding
            ids = as_placeholders(ids, self.image_token)
        if len(ids) + max_tokens > self.max_position:
            return []
        kv = req.spec_state if isinstance(req.spec_state, DraftKV) else DraftKV()
        req.spec_state = kv
        same = 0  # the cached tokens the request still has (a rejected draft is cut off)
        for a, b in zip(kv.ids, ids):
            if a != b:
                break
            same += 1
        kv.cut(min(same, len(ids) - 1))  # at least the last token is fed: its logits draft the first
        feed, draft = ids[kv.length :], []
        if self.topk > 1:
            return self._tree(kv, feed, max_tokens)
        for _ in range(max_tokens):
            states = self._forward(kv, feed, list(range(kv.length, kv.length + len(feed))))
            kv.length += len(feed)
            kv.ids.extend(feed)
            token = int(self.model.compute_logits(states[-1:]).argmax(dim=-1)[0])
            draft.append(token)
            feed = [token]
        return draft

    def _forward(self, kv: DraftKV, tokens: list[int], positions: list[int]) -> torch.Tensor:
        return self.model(
            torch.tensor(tokens, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            ForwardContext(self.attention, kv),
        )

    def _top(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return top_k(self.model.compute_logits(states), self.topk)

    def _tree(self, kv: DraftKV, feed: list[int], depth: int) -> DraftTree:
        """The request's unseen tokens fed, then a tree searched from the last one's output (see
        :mod:`~llmkit.plugins.speculative.tree_search`). The search's rows are cut off after: the
        next proposal re-feeds the tokens the target kept, so the cache holds one sequence."""
        start = kv.length
        states = self._forward(kv, feed, list(range(start, start + len(feed))))
        kv.length += len(feed)
        kv.ids.extend(feed)
        exact = kv.length
        try:
            return search_tree(
                kv, states[-1:], lambda _in, toks, pos: self._forward(kv, toks, pos), self._top, depth, exact
            )
        finally:
            kv.cut(exact)
