"""A follower rank of a tensor-parallel engine.

``python -m llmkit.core.engine.procs.tp_worker CONFIG_JSON RANK``: joins the group and runs every step
rank 0 broadcasts (see :mod:`llmkit.core.engine.procs.tp`). It exits when rank 0 says stop, when its
parent is gone, when a collective fails because a peer died, or when rank 0 goes silent (no step
and no heartbeat for ``step_wire.PEER_TIMEOUT_S``: its node lost power or the network is cut).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from dataclasses import replace

from llmkit.core.engine.config import EngineConfig
from llmkit.core.engine.procs.tp import brief_error, leave_exit_note, rank_device, run_follower

log = logging.getLogger("llmkit")


def _exit_with_parent() -> None:
    parent = os.getppid()
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            log.error("the process that started this rank is gone; exiting")
            os._exit(1)


def main(argv: list[str]) -> int:
    config = EngineConfig(**json.loads(argv[0]))
    rank = int(argv[1])
    logging.basicConfig(
        level=logging.INFO,
        format=f"[%(asctime)s engine rank {config.dp_rank} tp {rank}] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
    )
    threading.Thread(target=_exit_with_parent, name="llmkit-parent-watch", daemon=True).start()
    config = replace(config, device=rank_device(config, rank))
    try:
        return run_follower(config, rank)
    except Exception as exc:  # a dead peer surfaces here as a failed or timed-out collective
        log.error("tensor-parallel rank %d failed: %s", rank, brief_error(exc))
        leave_exit_note(brief_error(exc))
        logging.shutdown()
        os._exit(1)  # not sys.exit: the group's teardown would wait on a collective left pending


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
