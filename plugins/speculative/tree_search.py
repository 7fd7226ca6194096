"""The tree a draft model or head proposes under ``--speculative-eagle-topk K`` (K > 1), as EAGLE-2
and SGLang build it: the drafter's top K tokens at the first position; then at each further depth
the K best paths so far (by the sum of their tokens' log-probabilities) each get their top K
children; the tree is the best-scored candidates (each with its parent), its main chain the best
child at every level from the root.

A depth's paths run as one batch of the drafter, each row masked (``DraftKV.mask``) to the rows
the drafter had before the search (the request's own tokens) and to its own path's rows.
"""

from __future__ import annotations

from typing import Callable

import torch

from llmkit.core.speculative.tree import DraftTree, path_of
from llmkit.plugins.speculative.draft_cache import DraftKV

# feed(inputs, tokens, positions): the drafter's output rows for ``tokens`` at ``positions``, their
# K/V appended to the search's DraftKV; ``inputs``: the output rows of their parents (what predicted
# them: a head's next input; a draft model ignores them)
Feed = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]
# top(out): each output row's top K target token ids and their log-probabilities, [rows, K] each
Top = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def search_tree(kv: DraftKV, root_out: torch.Tensor, feed: Feed, top: Top, depth: int, first: int) -> DraftTree:
    """``root_out``: the drafter's output row that predicts the first draft token; ``first``: the
    position a depth-1 token is fed at (a depth-d one at ``first + d - 1``); at most ``depth`` deep
    and ``depth * K`` nodes."""
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    fed: dict[int, int] = {}  # node -> its row in kv
    ids, logp = top(root_out)
    k = ids.shape[1]
    frontier = []
    for tok, sc in zip(ids[0].tolist(), logp[0].tolist()):
        frontier.append(len(tokens))
        tokens.append(tok)
        parents.append(-1)
        scores.append(sc)
    inputs = root_out.expand(len(frontier), *root_out.shape[1:])
    exact = kv.length
    for d in range(1, depth):
        rows, start = len(frontier), kv.length
        mask = torch.zeros(rows, start + rows, dtype=torch.bool, device=root_out.device)
        mask[:, :exact] = True
        for r, node in enumerate(frontier):
            fed[node] = start + r
            mask[r, [fed[a] for a in path_of(parents, node)]] = True  # its ancestors' rows and its own
        kv.mask = mask
        try:
            out = feed(inputs, [tokens[i] for i in frontier], [first + d - 1] * rows)
        finally:
            kv.mask = None
        kv.length += rows
        kv.ids.extend(tokens[i] for i in frontier)
        ids, logp = top(out)
        total = torch.tensor([scores[i] for i in frontier], device=logp.device)[:, None] + logp
        children = []
        for r, node in enumerate(frontier):
            for tok, sc in zip(ids[r].tolist(), total[r].tolist()):
                children.append((sc, len(tokens), r))
                tokens.append(tok)
                parents.append(node)
                scores.append(sc)
        best = sorted(children, key=lambda c: -c[0])[:k]
        frontier = [c[1] for c in best]
        inputs = out[[c[2] for c in best]]
    return best_tree(tokens, parents, scores, depth * k)


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``k`` likeliest ids and their log-probabilities, ``[rows, k]`` each."""
    top = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return top.indices, top.values


def best_tree(tokens: list[int], parents: list[int], scores: list[float], max_nodes: int) -> DraftTree:
    """The ``max_nodes`` best-scored candidates (each with its parent), its main chain the best
    child of each node from the root."""
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))
    keep: set[int] = set()
    for i in order:
        if len(keep) >= max_nodes:
            break
        if parents[i] < 0 or parents[i] in keep:
            keep.add(i)
    node, chain = -1, []
    while True:  # the main chain: the best kept child at every level
        kids = [i for i in keep if parents[i] == node]
        if not kids:
            break
        node = max(kids, key=lambda i: scores[i])
        chain.append(tokens[node])
    paths = [chain]
    leaves = sorted((i for i in keep if not any(parents[j] == i for j in keep)), key=lambda i: -scores[i])
    for leaf in leaves:
        paths.append([tokens[i] for i in path_of(parents, leaf)])
    return DraftTree.from_paths(paths, max_nodes=len(keep), max_depth=max(len(p) for p in paths))
