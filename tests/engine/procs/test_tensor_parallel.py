"""``llmkit serve --tp-size 2``: ranks in their own processes on gloo, against TP=1.

Unit: the sharding arithmetic and a rank's share of the weights (read as slices). Servers: greedy
output and logprobs of tiny random-weight Llama and Qwen3 models equal TP=1 (one request, a
concurrent batch, a radix-cached prefix, a seeded sample); TP=2 x DP=2; TP=2 across two "nodes"
(two process trees on loopback); a killed rank fails its clients and stops the server; a node
killed or silenced (SIGSTOP, as a power loss or a cut network) while serving or idle is found by
the other node within a bound (heartbeats, timeouts).
"""

from __future__ import annotations

import ast
import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from llmkit.core.engine.builder import build_model
from llmkit.core.model.loader.source import iter_safetensors, load_config
from llmkit.core.model.parallel import TPGroup
from llmkit.core.plugins import registry

from fault_utils import LongStreams
from model_utils import copy_embedded_tokenizer, save_tiny_model
from server_utils import free_port, server_log, start_server, stop_server, tp2_and_tp1

COMMON = ["--batch-storage", "none", "--enable-deterministic-inference", "--num-threads", "1"]
PROMPTS = [[(7 * i + j) % 500 + 3 for j in range(4 + i % 9)] for i in range(12)]


# --- units ----------------------------------------------------------------------------------------


def test_units_split_evenly_and_replicate_when_fewer_than_ranks():
    assert [TPGroup(r, 2).units(4, "heads") for r in range(2)] == [(0, 2), (2, 4)]
    # 2 KV heads on 4 ranks: ranks 0-1 share head 0, ranks 2-3 head 1
    assert [TPGroup(r, 4).units(2, "kv heads") for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    with pytest.raises(ValueError, match="not divisible"):
        TPGroup(0, 2).units(3, "heads")


@pytest.fixture(scope="module")
def llama_dir(tiny_llama):
    return str(tiny_llama)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-qwen3-tp")
    save_tiny_model("qwen3", d)
    copy_embedded_tokenizer(d)
    return str(d)


def test_each_rank_holds_its_slice_of_the_weights(llama_dir):
    """Built as rank r of 2 (no collectives run while loading), each rank holds half of every
    sharded weight, and the two halves put together are the whole checkpoint tensor."""
    path = Path(llama_dir)
    cfg = load_config(path)
    cls = registry().model(cfg["architectures"][0])
    whole = build_model(cls, cfg, torch.device("cpu"), torch.float32)
    whole.load_weights(iter_safetensors(path))
    ranks = []
    for r in range(2):
        m = build_model(cls, cfg, torch.device("cpu"), torch.float32, TPGroup(r, 2))
        m.load_weights(iter_safetensors(path, lazy=True))
        ranks.append(dict(m.named_parameters()))
    full = dict(whole.named_parameters())
    n_full = sum(p.numel() for p in full.values())
    n_rank = sum(p.numel() for p in ranks[0].values())
    assert n_rank < 0.55 * n_full  # only the norms are replicated
    o = "layers.0.self_attn.o_proj.weight"  # row-parallel: input columns split
    assert torch.equal(torch.cat([ranks[0][o], ranks[1][o]], dim=1), full[o])
    d = "layers.1.mlp.down_proj.weight"
    assert torch.equal(torch.cat([ranks[0][d], ranks[1][d]], dim=1), full[d])
    # column-parallel fused QKV: each rank holds its query heads then its KV heads
    qkv = "layers.0.self_attn.qkv_proj.weight"
    hd, q, kv = 16, 4 * 16, 2 * 16
    w = full[qkv]
    for r in range(2):
        want = torch.cat(
            [
                w[r * q // 2 : (r + 1) * q // 2],
                w[q + r * kv // 2 : q + (r + 1) * kv // 2],
                w[q + kv + r * kv // 2 : q + kv + (r + 1) * kv // 2],
            ]
        )
        assert want.shape[0] == 4 * hd and torch.equal(ranks[r][qkv], want)
    e = "embed_tokens.weight"  # vocabulary rows
    assert torch.equal(torch.cat([ranks[0][e], ranks[1][e]]), full[e])


def test_no_pickle_on_the_process_boundary():
    """Every process boundary (server <-> engine, rank 0 <-> ranks) is msgpack or int64 tensors."""
    root = Path(__file__).resolve().parents[3] / "core" / "engine"
    files = ["ipc.py", "worker.py", "process_client.py", "dp_client.py", "tp.py", "tp_worker.py", "tp_launch.py"]
    files = [f"procs/{f}" for f in [*files, "tp_node.py"]] + ["step_wire.py"]
    banned = re.compile(r"pickle|_pyobj|_object")  # pickle, recv_pyobj, broadcast_object_list, ...
    for name in files:
        for node in ast.walk(ast.parse((root / name).read_text())):
            used = []
            if isinstance(node, ast.Import):
                used = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                used = [node.module or ""] + [a.name for a in node.names]
            elif isinstance(node, ast.Attribute):
                used = [node.attr]
            elif isinstance(node, ast.Name):
                used = [node.id]
            assert not any(banned.search(u) for u in used), (name, used)


# --- servers ----------------------------------------------------------------------------------------


async def _complete_all(url: str, prompts, **kw) -> list:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        rs = await asyncio.gather(
            *[
                client.completions.create(
                    model="m",
                    prompt=p,
                    max_tokens=kw.get("max_tokens", 12),
                    temperature=kw.get("temperature", 0),
                    seed=kw.get("seed"),
                    logprobs=3,
                    extra_body={"ignore_eos": True},
                )
                for p in prompts
            ]
        )
    return [r.choices[0].logprobs for r in rs]


def _one_by_one(url: str, prompts, **kw) -> list:
    return [asyncio.run(_complete_all(url, [p], **kw))[0] for p in prompts]


def _assert_same(mine, theirs, tol=1e-4):
    """Same tokens; logprobs equal within float32 reduction-order noise (sums split over ranks)."""
    for a, b in zip(mine, theirs):
        assert a.tokens == b.tokens
        for x, y in zip(a.token_logprobs, b.token_logprobs):
            assert abs(x - y) < tol, (x, y)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pair(request, llama_dir, qwen3_dir):
    """(TP=2 server, TP=1 server) on the same tiny model."""
    path = llama_dir if request.param == "llama" else qwen3_dir
    with tp2_and_tp1(["--model-path", path, *COMMON]) as servers:
        yield servers


@pytest.mark.slow
def test_tp2_equals_tp1_greedy_batched_cached_and_seeded(pair):
    url2, url1, proc = pair
    info = httpx.get(url2 + "/get_server_info", timeout=30).json()
    assert info["tp_size"] == 2 and [r["rank"] for r in info["tp_ranks"]] == [0, 1]
    # one at a time, then all at once (mixed prefill/decode batches)
    _assert_same(_one_by_one(url2, PROMPTS[:4]), _one_by_one(url1, PROMPTS[:4]))
    _assert_same(asyncio.run(_complete_all(url2, PROMPTS)), asyncio.run(_complete_all(url1, PROMPTS)))
    # a long prompt sent twice: the second reuses the radix-cached prefix on every rank
    long = [(11 * j) % 500 + 3 for j in range(120)]
    first = _one_by_one(url2, [long])
    hits = httpx.get(url2 + "/get_server_info", timeout=30).json()["prefix_cache_hits"]
    again = _one_by_one(url2, [long + [9]])
    deadline = time.monotonic() + 10  # the engine process publishes its counters twice a second
    while httpx.get(url2 + "/get_server_info", timeout=30).json()["prefix_cache_hits"] < hits + 100:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    _assert_same(first, _one_by_one(url1, [long]))
    _assert_same(again, _one_by_one(url1, [long + [9]]))
    # sampling with a seed: rank 0 samples from the gathered logits, so the tokens are TP=1's
    kw = dict(temperature=1.0, seed=1234, max_tokens=16)
    _assert_same(
        asyncio.run(_complete_all(url2, PROMPTS[:3], **kw)), asyncio.run(_complete_all(url1, PROMPTS[:3], **kw))
    )
    assert "tensor-parallel rank 1 of 2" in server_log(proc, 20000)


@pytest.mark.slow
def test_tp2_times_dp2_matches_tp1(llama_dir):
    proc, url = start_server(["--model-path", llama_dir, "--tp-size", "2", "--dp-size", "2", *COMMON])
    try:
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        assert info["dp_size"] == 2 and all(len(r["tp_ranks"]) == 2 for r in info["replicas"])
        mine = asyncio.run(_complete_all(url, PROMPTS))
        served = [r["routed"] for r in httpx.get(url + "/get_server_info", timeout=30).json()["replicas"]]
        assert min(served) > 0, served
    finally:
        stop_server(proc)
    tp1, url1 = start_server(["--model-path", llama_dir, *COMMON])
    try:
        _assert_same(mine, asyncio.run(_complete_all(url1, PROMPTS)))
    finally:
        stop_server(tp1)


@pytest.mark.slow
def test_tp2_across_two_nodes_on_loopback(llama_dir, tmp_path):
    """Node 1 is its own process tree (``llmkit serve --node-rank 1``) that only runs rank 1."""
    node1, proc, url = _two_nodes(llama_dir, tmp_path, {}, {})
    try:
        try:
            info = httpx.get(url + "/get_server_info", timeout=30).json()
            assert [r["rank"] for r in info["tp_ranks"]] == [0]  # rank 1 lives on the other node
            mine = asyncio.run(_complete_all(url, PROMPTS[:6]))
        finally:
            stop_server(proc)
        # rank 0 told rank 1 to stop: node 1 exits cleanly on its own
        node1.wait(timeout=30)
        out = (tmp_path / "node1.log").read_text()
        assert node1.returncode == 0, out
        assert "node 1 of 2: tensor-parallel ranks 1-1" in out
    finally:
        _killpg(node1)
    tp1, url1 = start_server(["--model-path", llama_dir, *COMMON])
    try:
        _assert_same(mine, asyncio.run(_complete_all(url1, PROMPTS[:6])))
    finally:
        stop_server(tp1)


@pytest.mark.slow
def test_killed_rank_fails_its_clients_and_stops_the_server(llama_dir):
    proc, url = start_server(["--model-path", llama_dir, "--tp-size", "2", "--max-running-requests", "2", *COMMON])
    try:
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        pid = next(r["pid"] for r in info["tp_ranks"] if r["rank"] == 1)
        clients = LongStreams(url, 4)
        assert clients.started.wait(60)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        clients.join_all(since=killed)
        streams = clients.events
        errors = [e for ev in streams for e in ev if '"error"' in e]
        assert errors and all("tensor-parallel rank 1" in e for e in errors), [ev[-2:] for ev in streams]
        proc.wait(timeout=max(1.0, 10 - (time.monotonic() - killed)))
        assert proc.returncode != 0
        assert re.search(rf"tensor-parallel rank 1 \(pid {pid}\) died: killed by signal 9", server_log(proc, 20000))
    finally:
        stop_server(proc)


def _start_node1(llama_dir: str, nodes: list[str], log_path: Path, env: dict | None = None) -> subprocess.Popen:
    """Node 1 (``--node-rank 1``) as its own process group, its output in ``log_path``."""
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "llmkit.cli.main", "serve", "--model-path", llama_dir, *nodes, "--node-rank", "1"]
            + COMMON,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )


def _killpg(proc: subprocess.Popen) -> None:
    """SIGKILL a process group (the process and everything it started, stopped or not); fine if
    it is gone."""
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def _two_nodes(llama_dir: str, tmp_path: Path, env0: dict, env1: dict):
    """Node 1 (its process group) and node 0's server (``start_server``'s), both up."""
    addr = f"127.0.0.1:{free_port()}"
    nodes = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    node1 = _start_node1(llama_dir, nodes, tmp_path / "node1.log", env1)
    try:
        proc, url = start_server(["--model-path", llama_dir, *nodes, "--node-rank", "0", *COMMON], env=env0)
    except BaseException:
        _killpg(node1)
        raise
    return node1, proc, url


def _assert_streams_end_with(clients: LongStreams, text: str) -> None:
    """Each stream's last event is an OpenAI-shaped error containing ``text``."""
    for ev in clients.events:
        data = [e for e in ev if e.startswith("data:") and e != "data: [DONE]"]
        assert data and '"error"' in data[-1] and '"message"' in data[-1], ev[-3:]
        assert text in data[-1], data[-1]


@pytest.mark.slow
def test_dead_node_fails_every_client_and_stops_the_server(llama_dir, tmp_path):
    """Node 1 SIGKILLed (its whole process group) under open streams: every stream ends with an
    error naming the lost rank within seconds, and node 0's server exits non-zero saying why."""
    node1, proc, url = _two_nodes(llama_dir, tmp_path, {}, {})
    try:
        clients = LongStreams(url, 4)
        assert clients.started.wait(60)
        killed = time.monotonic()
        os.killpg(node1.pid, signal.SIGKILL)
        clients.join_all(since=killed, within=15)
        _assert_streams_end_with(clients, "node 1 (tensor-parallel rank 1) died")
        proc.wait(timeout=max(1.0, 15 - (time.monotonic() - killed)))
        assert proc.returncode != 0
        assert "node 1 (tensor-parallel rank 1) died or is unreachable" in server_log(proc, 20000)
    finally:
        _killpg(node1)
        stop_server(proc)
        _killpg(proc)


@pytest.mark.slow
def test_node1_exits_on_its_own_when_node0_dies(llama_dir, tmp_path):
    """Node 0 SIGKILLed (server, engine and rank 0): node 1 notices its lost peer and exits
    promptly, saying so, rather than wait for a step that never comes."""
    node1, proc, url = _two_nodes(llama_dir, tmp_path, {}, {})
    try:
        asyncio.run(_complete_all(url, PROMPTS[:2]))  # the group works; rank 1 now waits for a step
        killed = time.monotonic()
        os.killpg(proc.pid, signal.SIGKILL)
        node1.wait(timeout=15)
        out = (tmp_path / "node1.log").read_text()
        assert node1.returncode != 0, out
        assert "tensor-parallel rank 1 failed: RuntimeError" in out, out
        assert re.search(r"tensor-parallel rank 1 \(pid \d+\) failed: RuntimeError: .*; node 1 stops", out), out
        assert time.monotonic() - killed < 15
    finally:
        _killpg(node1)
        _killpg(proc)


@pytest.mark.slow
def test_node1_killed_while_idle_stops_the_server(llama_dir, tmp_path):
    """Node 1 SIGKILLed while node 0 serves nothing: node 0's next heartbeat (every 5 s) fails, and
    its server exits non-zero naming node 1, without any request."""
    node1, proc, url = _two_nodes(llama_dir, tmp_path, {}, {})
    try:
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        killed = time.monotonic()
        os.killpg(node1.pid, signal.SIGKILL)
        proc.wait(timeout=15)
        assert proc.returncode != 0
        assert "node 1 (tensor-parallel rank 1) died or is unreachable" in server_log(proc, 20000)
        assert time.monotonic() - killed < 15
    finally:
        _killpg(node1)
        stop_server(proc)
        _killpg(proc)


@pytest.mark.slow
def test_node1_exits_when_node0_goes_silent(llama_dir, tmp_path):
    """Node 0 SIGSTOPped (a power loss or a cut network: no connection closes): node 1 hears no
    step and no heartbeat for its bound (3 s here, by the env override) and exits non-zero."""
    fast = {"LLMKIT_TP_HEARTBEAT_S": "0.5", "LLMKIT_TP_PEER_TIMEOUT_S": "3"}
    node1, proc, url = _two_nodes(llama_dir, tmp_path, fast, fast)
    try:
        asyncio.run(_complete_all(url, PROMPTS[:2]))
        time.sleep(1.5)  # a few heartbeats go by: rank 1 stays up while node 0 is idle
        assert node1.poll() is None
        stopped = time.monotonic()
        os.killpg(proc.pid, signal.SIGSTOP)
        node1.wait(timeout=15)
        out = (tmp_path / "node1.log").read_text()
        assert node1.returncode != 0, out
        assert "tensor-parallel rank 1 failed: TimeoutError: no step or heartbeat from tensor-parallel rank 0" in out
        assert re.search(r"tensor-parallel rank 1 \(pid \d+\) failed: TimeoutError: no step .*; node 1 stops", out), out
        assert time.monotonic() - stopped < 15
    finally:
        _killpg(node1)
        _killpg(proc)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["idle", "serving"])
def test_silent_node1_fails_every_client_and_stops_the_server(llama_dir, tmp_path, when):
    """Node 1 SIGSTOPped: idle, node 0's heartbeat is not taken up within its bound; serving, a
    step's collective times out (3 s bounds here, by the env overrides). Either way every client
    gets an error naming node 1 and node 0's server exits non-zero."""
    fast = {"LLMKIT_TP_HEARTBEAT_S": "0.5", "LLMKIT_TP_PEER_TIMEOUT_S": "3", "LLMKIT_TP_STEP_TIMEOUT_S": "3"}
    node1, proc, url = _two_nodes(llama_dir, tmp_path, fast, {})
    try:
        clients = None
        if when == "serving":
            clients = LongStreams(url, 4)
            assert clients.started.wait(60)
        stopped = time.monotonic()
        os.killpg(node1.pid, signal.SIGSTOP)
        if clients is not None:
            clients.join_all(since=stopped, within=15)
            _assert_streams_end_with(clients, "node 1 (tensor-parallel rank 1) died or is unreachable")
        proc.wait(timeout=max(1.0, 15 - (time.monotonic() - stopped)))
        assert proc.returncode != 0
        assert "node 1 (tensor-parallel rank 1) died or is unreachable" in server_log(proc, 20000)
    finally:
        _killpg(node1)
        stop_server(proc)
        _killpg(proc)


def test_a_model_without_tensor_parallelism_is_refused_before_any_rank_starts(tmp_path):
    """One line naming the architecture, not the first follower's death ("rank 1 died: exit code 1")."""
    from vl_utils import save_tiny_qwen2_5_vl

    save_tiny_qwen2_5_vl(tmp_path / "vl")
    with pytest.raises(RuntimeError) as err:
        start_server(["--model-path", str(tmp_path / "vl"), "--tp-size", "2"])
    log = str(err.value)
    assert "Qwen2_5_VLForConditionalGeneration does not support tensor parallelism (--tp-size 2)" in log, log
    assert "died" not in log and "tensor parallel: 2 ranks" not in log, log


def test_a_follower_that_cannot_build_is_reported_with_its_error(tmp_path):
    """9 attention heads cannot split over 2 ranks: the server's error is the follower's own
    reason, not "rank 1 died: exit code 1"."""
    save_tiny_model(
        "llama", tmp_path / "odd", hidden_size=144, num_attention_heads=9, num_key_value_heads=3, head_dim=16
    )
    with pytest.raises(RuntimeError) as err:
        start_server(["--model-path", str(tmp_path / "odd"), "--tp-size", "2"])
    last = str(err.value).strip().splitlines()[-1]
    assert re.fullmatch(r"error: tensor-parallel rank 1 \(pid \d+\) failed: ValueError: .*not divisible.*", last), last
