"""The breadth families that declare tensor parallelism, sharded over two ranks (gloo on CPU, one
process per rank): heads split (partial rotary, sliding windows, NoPE layers, Phi-3's fused
projections split before sharding), experts' channels split, Granite's multipliers; each rank's
logits equal transformers' on the whole model. OLMo 2/3 and MiniMax-M2 (Q/K norms over every
head) refuse ``--tp-size``."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from llmkit.core.engine.builder import build_model
from llmkit.core.model.loader.source import load_config
from llmkit.core.model.parallel import TPGroup
from llmkit.core.plugins import registry

from breadth_utils import save_tiny
from tests.model.moe.test_moe_tensor_parallel import IDS, _rank

pytestmark = pytest.mark.slow  # two spawned processes per model


@pytest.mark.parametrize("arch", ["mistral", "mixtral", "phi3", "smollm3", "granite", "glm4_moe"])
def test_two_ranks_match_transformers(tmp_path, arch):
    model_dir = tmp_path / "model"
    ref = save_tiny(arch, model_dir)
    with torch.no_grad():
        full = ref(torch.tensor([IDS])).logits[0]
    init = f"file://{tmp_path / 'rendezvous'}"
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(2)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, 2, init, str(model_dir), outs[r])) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    for out in outs:
        got = torch.load(out)
        assert got["heads"] == 2  # half of the 4 query heads on each rank
        assert torch.allclose(got["logits"], full, atol=1e-4, rtol=1e-4), (got["logits"] - full).abs().max()


@pytest.mark.parametrize("arch", ["olmo2", "minimax_m2"])
def test_whole_projection_qk_norms_refuse_tensor_parallelism(tmp_path, arch):
    save_tiny(arch, tmp_path)
    config = load_config(tmp_path)
    cls = registry().model(config["architectures"][0])
    with pytest.raises(ValueError, match="does not support tensor parallelism"):
        build_model(cls, config, torch.device("cpu"), torch.float32, tp=TPGroup(rank=0, size=2, group=None))
