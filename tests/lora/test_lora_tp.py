"""LoRA adapters under ``--tp-size 2``: each rank holds its share of A and B.

Unit: the layers of two simulated ranks (built in one process, their all-reduce left to the test)
give the unsharded layer's adapted output: column-parallel rows concatenated, row-parallel partial
outputs summed. Servers (real rank processes on gloo): greedy completions with adapter a, adapter b,
the base, and a mixed concurrent batch equal a ``--tp-size 1`` server's; an adapter loaded at run
time serves on every rank, is unloaded and loaded again. Two rank processes on gloo: a load that
fails on rank 1 alone is refused on rank 0 too, and the next load goes through on both.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest
import torch

from llmkit.core.engine.builder import build_model
from llmkit.core.lora.manager import LoRAManager
from llmkit.core.model.loader.source import iter_safetensors, load_config
from llmkit.core.model.parallel import TPGroup
from llmkit.core.plugins import registry

from lora_utils import save_adapter, save_tiny_llama
from server_utils import server_log, tp2_and_tp1

COMMON = ["--device", "cpu", "--batch-storage", "none", "--enable-deterministic-inference", "--num-threads", "1"]
PROMPTS = [[(7 * i + j) % 500 + 3 for j in range(4 + i % 9)] for i in range(8)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-tp")
    save_tiny_llama(root / "base")
    save_adapter(root / "base", root / "a", seed=1, r=8)
    save_adapter(root / "base", root / "b", seed=2, r=4, targets=["q_proj", "v_proj", "down_proj"])
    save_adapter(root / "base", root / "c", seed=3, r=4, rslora=True)
    return root


# --- unit: two ranks in one process ----------------------------------------------------------------


class _Deferred(TPGroup):
    """A rank of 2 whose all-reduce is left to the caller (the test sums the ranks' outputs)."""

    def all_reduce(self, x):
        return x


def _build(path: Path, tp=None):
    cfg = load_config(path)
    m = build_model(registry().model(cfg["architectures"][0]), cfg, torch.device("cpu"), torch.float32, tp)
    m.load_weights(iter_safetensors(path, lazy=tp is not None))
    return m


def test_sharded_layers_equal_the_unsharded_one(models):
    base = models / "base"
    whole = LoRAManager(_build(base), max_rank=8, max_per_batch=4)
    ranks = [LoRAManager(_build(base, _Deferred(r, 2)), max_rank=8, max_per_batch=4) for r in range(2)]
    # (rank 1 knows adapters by uid only: its loads' results are the handles)
    held = {id(m): (m.load("a", str(models / "a")), m.load("b", str(models / "b"))) for m in (whole, *ranks)}
    g = torch.Generator().manual_seed(0)
    for name, layer in whole.layers.items():
        x = torch.randn(5, layer.in_features, generator=g)
        outs = []
        for m in (whole, *ranks):
            a, b = held[id(m)]
            lin = m.layers[name]
            xs = x[:, lin._cols]  # a row-parallel rank's input columns (all of them otherwise)
            m.activate([a, None, b], [2, 1, 2], torch.device("cpu"))
            wrapped = m.model.get_submodule(name)
            try:
                outs.append((wrapped(xs), lin))
            finally:
                m.deactivate()
        y, _ = outs[0]
        (y0, l0), (y1, l1) = outs[1:]
        if l0.parallel == "row":
            torch.testing.assert_close(y0 + y1, y, rtol=1e-5, atol=1e-5)
        else:  # each part's rows: rank 0's then rank 1's
            assert l0.parallel == "column"
            start, pieces = 0, []
            for part, rows in enumerate(l0.part_rows):
                for yr, lr in ((y0, l0), (y1, l1)):
                    lo, hi, dst = lr._row_map[part]
                    pieces.append((start + lo, yr[:, dst : dst + hi - lo]))
                start += rows
            got = torch.cat([p for _, p in sorted(pieces, key=lambda t: t[0])], dim=1)
            torch.testing.assert_close(got, y, rtol=1e-5, atol=1e-5)
        # the adapters change this layer's output (else the check above says little)
        assert not torch.allclose(y, whole.layers[name](x), atol=1e-4)


# --- servers ---------------------------------------------------------------------------------------


async def _complete_all(url: str, jobs) -> list:
    """``jobs``: (model, prompt ids) each; all sent at once (one mixed batch)."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        rs = await asyncio.gather(
            *[
                client.completions.create(
                    model=model,
                    prompt=p,
                    max_tokens=10,
                    temperature=0,
                    logprobs=1,
                    extra_body={"ignore_eos": True},
                )
                for model, p in jobs
            ]
        )
    return [r.choices[0].logprobs for r in rs]


def _one_by_one(url: str, jobs) -> list:
    return [asyncio.run(_complete_all(url, [j]))[0] for j in jobs]


def _assert_same(mine, theirs, tol=1e-4):
    """Same greedy tokens; logprobs equal within float32 reduction-order noise."""
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs):
        assert a.tokens == b.tokens
        for x, y in zip(a.token_logprobs, b.token_logprobs):
            assert abs(x - y) < tol, (x, y)


def _post(url, path, body):
    return httpx.post(url + path, json=body, timeout=120)


@pytest.fixture(scope="module")
def pair(models):
    """(TP=2 server, TP=1 server), both serving adapters a and b from the start."""
    args = ["--model-path", str(models / "base"), *COMMON, "--max-lora-rank", "8"]
    args += ["--lora-paths", f"a={models / 'a'}", f"b={models / 'b'}"]
    with tp2_and_tp1(args) as servers:
        yield servers


@pytest.mark.slow
def test_tp2_adapters_equal_tp1(pair):
    url2, url1, _ = pair
    jobs = [(model, p) for model in ("a", "b", "m") for p in PROMPTS[:2]]
    mine, theirs = _one_by_one(url2, jobs), _one_by_one(url1, jobs)
    _assert_same(mine, theirs)
    # each adapter changes the output: the test compares adapted forwards, not three base ones
    assert len({tuple(lp.tokens) for lp in mine[::2]}) == 3
    # one mixed batch: a's, b's and base rows side by side
    mixed = [(("a", "b", "m")[i % 3], p) for i, p in enumerate(PROMPTS)]
    _assert_same(asyncio.run(_complete_all(url2, mixed)), asyncio.run(_complete_all(url1, mixed)))
    _assert_same(asyncio.run(_complete_all(url2, mixed)), _one_by_one(url1, mixed))


@pytest.mark.slow
def test_tp2_run_time_load_and_unload(pair, models, tmp_path):
    url2, url1, proc = pair
    body = {"lora_name": "c", "lora_path": str(models / "c")}
    for url in (url2, url1):
        r = _post(url, "/load_lora_adapter", body)
        assert r.status_code == 200, r.text
    jobs = [("c", PROMPTS[3]), ("a", PROMPTS[3]), ("m", PROMPTS[3])]
    c2 = asyncio.run(_complete_all(url2, jobs))
    _assert_same(c2, asyncio.run(_complete_all(url1, jobs)))
    assert c2[0].tokens != c2[2].tokens
    # a path no rank can read: refused, and the ranks serve on in step
    r = _post(url2, "/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "none")})
    assert r.status_code == 400 and "not a directory" in r.text
    assert _post(url2, "/unload_lora_adapter", {"lora_name": "c"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        asyncio.run(_complete_all(url2, [("c", PROMPTS[3])]))
    _assert_same(asyncio.run(_complete_all(url2, jobs[1:])), asyncio.run(_complete_all(url1, jobs[1:])))
    # loaded again (a new uid on every rank; the old copy dropped by the other rank)
    assert _post(url2, "/load_lora_adapter", body).status_code == 200
    _assert_same(asyncio.run(_complete_all(url2, jobs)), c2)
    log = server_log(proc, 50000)
    assert "LoRA adapter 'c' (uid 3) loaded" in log and "LoRA adapter 'c' (uid 5) loaded" in log  # on rank 1
    # rank 1 dropped the first c once rank 0's requests with it were gone (uid 4: the refused load)
    assert "LoRA adapter 'c' (uid 3) dropped" in log
    assert _post(url2, "/unload_lora_adapter", {"lora_name": "c"}).status_code == 200
    assert _post(url1, "/unload_lora_adapter", {"lora_name": "c"}).status_code == 200


_RANK_SCRIPT = """
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from llmkit.core.engine.builder import build_model
from llmkit.core.lora.manager import LoRAManager
from llmkit.core.model.loader.source import iter_safetensors, load_config
from llmkit.core.model.parallel import TPGroup
from llmkit.core.plugins import registry

rank, port, base, good, bad = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
tp = TPGroup(rank, 2, dist.group.WORLD)
cfg = load_config(base)
model = build_model(registry().model(cfg["architectures"][0]), cfg, torch.device("cpu"), torch.float32, tp)
model.load_weights(iter_safetensors(base, lazy=True))
m = LoRAManager(model, max_rank=8, max_per_batch=4)


class Told:  # rank 0's wire, here: rank 1 is told by this script instead
    def send_lora_load(self, name, path, uid):
        pass

    def fail(self, exc):
        raise AssertionError(exc)


if rank == 0:
    m.channel = Told()
    try:
        m.load("x", good)
    except ValueError as exc:
        print("REFUSED", exc)
    print("NAMES", sorted(m.adapters))
    m.load("y", good)
    print("NAMES", sorted(m.adapters))
else:
    m.load_on_follower("x", bad, 1)  # this rank alone cannot read it
    print("HELD", sorted(m._held))
    m.load_on_follower("y", good, 2)
    print("HELD", sorted(m._held))
dist.barrier()  # leave together (see tests/speculative/test_target_vocab.py)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.slow
def test_a_load_one_rank_cannot_read_is_loaded_on_none(models, tmp_path):
    """Two real ranks on gloo agree on a run-time load: rank 1 failing refuses it on rank 0 too."""
    import subprocess
    import sys

    from server_utils import free_port

    port = str(free_port())
    args = [str(models / "base"), str(models / "a"), str(tmp_path / "missing")]
    procs = [
        subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT, str(r), port, *args], stdout=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "REFUSED LoRA adapter 'x'" in outs[0] and "tensor-parallel rank 1" in outs[0], outs[0]
    assert "NAMES []\nNAMES ['y']" in outs[0]
    assert "HELD []\nHELD [2]" in outs[1]
