"""The target's embedding and LM head gathered for rank 0 under ``--tp-size 2`` (what a draft head
reads there): two real rank processes on gloo, each holding half of a tiny Llama's vocabulary rows
(509 of them: the last rank's share is padded), read out in several pieces. Rank 0's copies equal
the checkpoint's tables, for a separate LM head and a tied one; rank 1 gets none."""

from __future__ import annotations

import pytest
import torch
from rank_utils import run_two_ranks

from model_utils import save_tiny_model

pytestmark = pytest.mark.slow  # two rank processes per case

_RANK_SCRIPT = """
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from llmkit.core.engine.builder import build_model
from llmkit.core.model import quantize
from llmkit.core.model.loader.source import iter_safetensors, load_config
from llmkit.core.model.parallel import TPGroup
from llmkit.core.plugins import registry
from llmkit.core.speculative import target_vocab
from llmkit.core.speculative.target_vocab import gather_target_vocab

rank, port, path, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
tp = TPGroup(rank, 2, dist.group.WORLD)
cfg = load_config(path)
model = build_model(registry().model(cfg["architectures"][0]), cfg, torch.device("cpu"), torch.float32, tp)
model.load_weights(iter_safetensors(path))
quantize.finalize_weights(model)
target_vocab._ROWS, target_vocab._HEAD_BYTES = 100, 4 * 509 * 5  # several reads of each table
tables = gather_target_vocab(model, rank == 0, torch.float32)
if rank == 0:
    torch.save({"embed": tables.embed.weight, "head": tables.head}, out)
else:
    assert tables is None
# Both ranks leave together, and skip the interpreter's teardown: a gloo rank torn down while its
# peer still talks (or its threads met at finalisation) can abort with "terminate called".
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.parametrize("tied", [False, True], ids=["own-head", "tied"])
def test_rank_0_gets_the_whole_tables(tmp_path, tied):
    hf = save_tiny_model("llama", tmp_path / "model", vocab_size=509, tie_word_embeddings=tied)
    out = tmp_path / "tables.pt"
    run_two_ranks(_RANK_SCRIPT, str(tmp_path / "model"), str(out))
    tables = torch.load(out)
    embed = hf.model.embed_tokens.weight.detach()
    assert tables["embed"].shape == (509, embed.shape[1])
    assert torch.equal(tables["embed"], embed)
    assert torch.equal(tables["head"], hf.lm_head.weight.detach())
    if tied:
        assert tables["head"].data_ptr() == tables["embed"].data_ptr()  # one copy
