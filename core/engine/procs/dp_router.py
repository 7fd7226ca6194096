"""Which data-parallel replica gets a request: the least loaded one, unless another replica
already holds a long prefix of the prompt and is not much busier.

Each replica has its own radix cache, so a conversation's next turn (or another request with the
same long system prompt) prefills far less on the replica that served the last one. The router
remembers, for each prompt it routed, the hashes of its prefixes at ``block``-token boundaries
(a chain, so equal hashes mean equal prefixes) and which replica got it; a new prompt goes to the
owner of its longest remembered prefix when that replica's outstanding requests are at most
``slack`` above the least loaded one's, else to the least loaded (ties rotate). This is the
approximate-tree idea of SGLang's cache-aware router, kept to one bounded LRU table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixRouter:
    def __init__(
        self, replicas: int, *, block: int = 32, max_blocks: int = 256, slack: int = 4, capacity: int = 200_000
    ) -> None:
        self.replicas = replicas
        self.block = block
        self.max_blocks = max_blocks  # prefixes past block * max_blocks tokens are not told apart
        self.slack = slack
        self.capacity = capacity
        self._owner: OrderedDict[int, int] = OrderedDict()  # prefix hash -> replica (LRU)
        self._turn = 0  # rotates ties between equally loaded replicas

    def _prefix_hashes(self, ids: Sequence[int]) -> list[int]:
        out, h = [], 0
        for k in range(min(len(ids) // self.block, self.max_blocks)):
            h = hash((h, tuple(ids[k * self.block : (k + 1) * self.block])))
            out.append(h)
        return out

    def route(self, ids: Sequence[int], loads: Sequence[int]) -> int:
        """The replica for a prompt of token ``ids``, given each replica's outstanding requests."""
        n = self.replicas
        self._turn = (self._turn + 1) % n
        least = min(range(n), key=lambda i: (loads[i], (i - self._turn) % n))
        hashes = self._prefix_hashes(ids)
        owner = None
        for h in hashes:  # the longest remembered prefix (chained: a miss ends the match)
            r = self._owner.get(h)
            if r is None:
                break
            owner = r
        choice = owner if owner is not None and loads[owner] <= loads[least] + self.slack else least
        for h in hashes:
            self._owner[h] = choice
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
        return choice
