"""A node other than node 0 of a multi-node tensor-parallel engine (``--node-rank`` > 0).

It serves no HTTP: it starts its share of the ranks, which meet node 0's rank 0 at
``--dist-init-addr``, and waits. It exits when they do: 0 after rank 0 stopped them, non-zero
(naming the rank) when one failed, for example because node 0 went away.
"""

from __future__ import annotations

import logging
import signal
import time

from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.procs.tp import follower_ended, ranks_of_node, spawn_followers

log = logging.getLogger("llmkit")


def serve_ranks(config: EngineConfig) -> int:
    ranks = ranks_of_node(config)
    procs = spawn_followers(config, ranks)
    log.info(
        "node %d of %d: tensor-parallel ranks %d-%d, rendezvous %s",
        config.node_rank,
        config.nnodes,
        ranks.start,
        ranks.stop - 1,
        config.dist_init_addr,
    )

    def stop(signum, frame):
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    while procs:
        for rank, proc in list(procs.items()):
            rc = proc.poll()
            if rc is None:
                continue
            del procs[rank]
            if rc != 0:
                log.error(
                    "tensor-parallel rank %d (pid %d) %s; node %d stops",
                    rank,
                    proc.pid,
                    follower_ended(proc, rc),
                    config.node_rank,
                )
                code = 1
                stop(None, None)  # the group cannot go on without it
        time.sleep(0.2)
    return code
