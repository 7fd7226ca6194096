"""Tree drafts: several candidate continuations verified by one forward (``--speculative-eagle-topk``
above 1), sharing the rows of their common prefixes.

Node ``i`` is token ``tokens[i]``, a child of node ``parents[i]`` (-1: of the sequence's last
token, the root). Every parent comes before its children, and nodes ``0 .. L-1`` are one chain (each
the child of the one before): a proposer puts its best guess there, so that accepting it costs
what accepting a plain chain does.

How a tree is verified (``core.engine.model_runner`` and ``core.speculative.verify``): node ``i``
takes the KV slot the chain layout gives the draft's ``i``-th token (position ``p0 + 1 + i``, the
root at ``p0``) and is computed at position ``p0 + depth(i)`` as a sequence of its own, whose slot
list is the request's up to the root followed by its ancestors' and its own slots. So each node's
row is exactly a decode step of its path (the same keys, in the same order), whatever the tree.
Walking from the root, the token sampled from a node's row picks the child that carries it; the
kept nodes' K/V are then moved to the positions they now hold (a kept node ``n`` at depth ``d``
from ``p0 + 1 + n`` to ``p0 + d``: never onto a slot a later kept node still reads, since a node
at depth ``k`` has index at least ``k - 1``).
"""

from __future__ import annotations

from dataclasses import dataclass


def path_of(parents, node: int) -> list[int]:
    """The nodes from the root's child down to ``node``, in depth order (``parents[i]``: node
    ``i``'s parent, -1 the root); a tree still being built may pass its list."""
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    @staticmethod
    def from_paths(paths: list[list[int]], max_nodes: int, max_depth: int) -> DraftTree:
        """The trie of candidate continuations ``paths`` (best first: the first is the chain of
        nodes ``0 ..``), at most ``max_nodes`` nodes and ``max_depth`` deep; later paths add the
        nodes they do not share, breadth first."""
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for tok in (paths[0] if paths else [])[: min(max_depth, max_nodes)]:
            children[(len(tokens) - 1, tok)] = len(tokens)
            parents.append(len(tokens) - 1)
            tokens.append(tok)
        walks = [(-1, p[:max_depth]) for p in paths[1:]]
        for depth in range(max_depth):  # the other paths' new nodes, level by level
            nxt = []
            for node, path in walks:
                if depth >= len(path) or node is None:
                    continue
                key = (node, path[depth])
                if key not in children:
                    if len(tokens) >= max_nodes:
                        continue
                    children[key] = len(tokens)
                    parents.append(node)
                    tokens.append(path[depth])
                nxt.append((children[key], path))
            walks = nxt
        return DraftTree(tuple(tokens), tuple(parents))

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Each node's depth (the root's children: 1)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node``, in depth order."""
        return path_of(self.parents, node)

    def child(self, node: int, token: int) -> int | None:
        """The child of ``node`` (-1: the root) that carries ``token``, if any."""
        for i in range(node + 1, len(self.tokens)):
            if self.parents[i] == node and self.tokens[i] == token:
                return i
        return None

    def truncated(self, max_nodes: int, max_depth: int) -> DraftTree:
        """The first ``max_nodes`` nodes no deeper than ``max_depth`` (parents come first, so a
        kept node's parent is kept)."""
        depths = self.depths()
        keep, index = [], {-1: -1}
        for i, (tok, p) in enumerate(zip(self.tokens, self.parents)):
            if len(keep) < max_nodes and depths[i] <= max_depth and p in index:
                index[i] = len(keep)
                keep.append((tok, index[p]))
        return DraftTree(tuple(t for t, _ in keep), tuple(p for _, p in keep))

    def main_chain(self) -> list[int]:
        """The tokens of nodes ``0 .. L-1``, the chain the tree starts with."""
        length = next((i for i, p in enumerate(self.parents) if p != i - 1), len(self.parents))
        return list(self.tokens[:length])

    def is_chain(self) -> bool:
        return len(self.main_chain()) == len(self.tokens)
