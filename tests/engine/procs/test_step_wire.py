"""Rank 0's step reaches the other tensor-parallel ranks whole: two real rank processes on gloo,
rank 0 sends a step with every field a forward needs (a tree's per-node slot columns and the K/V
moves of its kept nodes among them) and its slot-table writes; rank 1 gets the same, and applies
the moves to its own pool as the follower loop does."""

from __future__ import annotations

import json

import pytest
from rank_utils import run_two_ranks

pytestmark = pytest.mark.slow  # two rank processes

_RANK_SCRIPT = """
import json
import os
import sys

import torch
import torch.distributed as dist
from llmkit.core.engine.step_wire import StepBroadcaster, StepInputs, receive_step
from llmkit.core.model.parallel import TPGroup

rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
tp = TPGroup(rank, 2, dist.group.WORLD)
sent = StepInputs(
    ids=[5, 6, 7, 8, 9], positions=[20, 21, 21, 22, 3], q_lens=[1, 1, 1, 1, 1], kv_lens=[21, 22, 22, 23, 4],
    rows=[2, 2, 2, 2, 0], sample_rows=[0, 1, 2, 3, 4], prompt_ranges=[], decoding=[1, 1, 1, 1, 1],
    tree_keys=[(1, 21, [21]), (2, 21, [22]), (3, 21, [21, 23])], kv_moves=[70, 66, 71, 67],
)
if rank == 0:
    StepBroadcaster(tp).send(sent, [(2, 20, torch.tensor([64, 65, 66, 67]))])
    got = None
else:
    inp, writes = receive_step(tp, 60)
    got = {
        "same": {k: getattr(inp, k) == getattr(sent, k) for k in vars(sent) if k not in ("loras", "from_prev")},
        "writes": [(r, s, t.tolist()) for r, s, t in writes],
    }
    # the follower's move (ModelRunner.move_kv) on a pool whose slot values are their own index
    from types import SimpleNamespace
    from llmkit.core.engine.model_runner import ModelRunner

    pool = SimpleNamespace(k_buffers=[torch.arange(80.0).view(80, 1, 1)], v_buffers=[])
    runner = SimpleNamespace(pool=pool, device=torch.device("cpu"))
    ModelRunner.move_kv(runner, inp.kv_moves)
    got["moved"] = [pool.k_buffers[0][i].item() for i in (66, 67, 70, 71)]
    with open(out, "w") as f:
        json.dump(got, f)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


def test_a_tree_step_reaches_the_other_rank_whole(tmp_path):
    out = tmp_path / "got.json"
    run_two_ranks(_RANK_SCRIPT, str(out), timeout=120)
    got = json.loads(out.read_text())
    assert all(got["same"].values()), got["same"]
    assert got["writes"] == [[2, 20, [64, 65, 66, 67]]]
    assert got["moved"] == [70.0, 71.0, 70.0, 71.0]  # slots 66 and 67 now hold 70's and 71's K/V
