"""LoRA through the real engine: rows of different adapters and of the base model in one batch
equal each row served alone; the prefix cache keeps each adapter's K/V to itself; adapters load
and unload between steps, and a bad one is refused with nothing loaded."""

from __future__ import annotations

import threading

import pytest

from llmkit.core.engine.messages import GenerateRequest, SamplingParams

from lora_utils import save_adapter, save_tiny_llama
from model_utils import start_engine

N = 8
PROMPT = [3, 17, 99, 250, 7, 401, 12, 5, 300, 42, 8, 1, 77, 23, 64, 9, 310, 2]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    save_tiny_llama(root / "base")
    save_adapter(root / "base", root / "a", seed=1, r=8)
    save_adapter(root / "base", root / "b", seed=2, r=4, targets=["q_proj", "v_proj", "down_proj"])
    save_adapter(root / "base", root / "c", seed=3, r=16, rslora=True, targets=["gate_proj", "up_proj", "o_proj"])
    return root


def _engine(dirs, **kw):
    kw.setdefault("lora_paths", tuple(f"{n}={dirs / n}" for n in "abc"))
    return start_engine(
        model_path=str(dirs / "base"),
        device="cpu",
        page_size=4,
        max_total_tokens=2048,
        enable_deterministic_inference=True,  # a row's numerics do not depend on its batch-mates
        **kw,
    )


def _submit(engine, rid, ids, lora):
    done, out = threading.Event(), {"ids": [], "cached": None, "error": None}

    def sink(o):
        out["ids"].extend(o.token_ids)
        if o.finished:
            out["cached"], out["error"] = o.cached_tokens, o.error
            done.set()

    params = SamplingParams(max_new_tokens=N, min_new_tokens=N, temperature=0)
    engine.submit(GenerateRequest(rid, list(ids), params, lora=lora), sink)
    return done, out


def _run(engine, jobs):
    """Submit every ``(rid, ids, lora)`` at once (one batch), wait for all."""
    waits = [_submit(engine, *job) for job in jobs]
    for done, _ in waits:
        assert done.wait(300)
    return [out for _, out in waits]


def _count_groups(engine) -> list[int]:
    """The adapter groups of each forward, recorded as the runner forms them."""
    seen, activate = [], engine.runner.lora.activate

    def spy(per_segment, q_lens, device):
        active = activate(per_segment, q_lens, device)
        seen.append(len(engine.runner.lora.batch.groups))
        return active

    engine.runner.lora.activate = spy
    return seen


def test_mixed_batch_equals_each_row_alone(dirs):
    engine = _engine(dirs)
    groups_seen = _count_groups(engine)
    try:
        loras = ["a", "b", "c", None]
        prompts = [PROMPT[i:] for i in range(4)]
        mixed = _run(engine, [(f"mix-{i}", p, lo) for i, (p, lo) in enumerate(zip(prompts, loras))])
        assert max(groups_seen) == 3  # three adapters' rows (and the base's) shared a forward
        alone = [_run(engine, [(f"alone-{i}", p, lo)])[0] for i, (p, lo) in enumerate(zip(prompts, loras))]
        assert [o["ids"] for o in mixed] == [o["ids"] for o in alone]
        assert len({tuple(o["ids"]) for o in mixed}) == 4  # each adapter changes the output
    finally:
        engine.shutdown()


def test_max_loras_per_batch_limits_the_adapters_of_a_forward(dirs):
    engine = _engine(dirs, max_loras_per_batch=1)
    groups_seen = _count_groups(engine)
    try:
        outs = _run(engine, [(f"lim-{i}", PROMPT, lo) for i, lo in enumerate(("a", "b", "c", "a"))])
        assert groups_seen and max(groups_seen) == 1  # the others waited their turn
        assert outs[0]["ids"] == outs[3]["ids"] and all(o["error"] is None for o in outs)
    finally:
        engine.shutdown()


def test_prefix_cache_is_per_adapter(dirs):
    engine = _engine(dirs)
    try:
        first_a = _run(engine, [("a1", PROMPT, "a")])[0]
        b = _run(engine, [("b1", PROMPT, "b")])[0]
        assert b["cached"] == 0  # a's K/V of the same prompt is not b's
        again_a = _run(engine, [("a2", PROMPT, "a")])[0]
        assert again_a["cached"] > 0 and again_a["ids"] == first_a["ids"]  # a hits its own prefix
        base = _run(engine, [("base", PROMPT, None)])[0]
        assert base["cached"] == 0
    finally:
        engine.shutdown()
    fresh = _engine(dirs)
    try:
        assert _run(fresh, [("b-alone", PROMPT, "b")])[0]["ids"] == b["ids"]
    finally:
        fresh.shutdown()


def test_load_unload_and_bad_adapters(dirs, tmp_path):
    engine = _engine(dirs, lora_paths=(), enable_lora=True, max_lora_rank=8)
    lora = engine.runner.lora
    try:
        refused = _run(engine, [("x", PROMPT, "a")])[0]
        assert "not loaded" in refused["error"]
        engine.call(lambda: lora.load("a", str(dirs / "a"))).result(60)
        with_a = _run(engine, [("y", PROMPT, "a")])[0]
        assert with_a["error"] is None
        with pytest.raises(ValueError, match="rank 16 is over --max-lora-rank 8"):
            engine.call(lambda: lora.load("c", str(dirs / "c"))).result(60)
        corrupt = tmp_path / "corrupt"
        corrupt.mkdir()
        (corrupt / "adapter_config.json").write_text((dirs / "b" / "adapter_config.json").read_text())
        (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
        with pytest.raises(ValueError, match="cannot be read"):
            engine.call(lambda: lora.load("bad", str(corrupt))).result(60)
        save_tiny_llama(tmp_path / "other", hidden_size=32, intermediate_size=64)
        save_adapter(tmp_path / "other", tmp_path / "other-ad", seed=4, r=4)
        with pytest.raises(ValueError, match="another base model"):
            engine.call(lambda: lora.load("other", str(tmp_path / "other-ad"))).result(60)
        save_adapter(dirs / "base", tmp_path / "embed", seed=5, r=4, targets=["embed_tokens", "q_proj"])
        with pytest.raises(ValueError, match="embedding and LM-head adapters"):
            engine.call(lambda: lora.load("embed", str(tmp_path / "embed"))).result(60)
        assert set(lora.adapters) == {"a"}  # nothing half loaded
        engine.call(lambda: lora.unload("a")).result(60)
        assert "not loaded" in _run(engine, [("z", PROMPT, "a")])[0]["error"]
        engine.call(lambda: lora.load("a", str(dirs / "a"))).result(60)  # reloaded: same outputs
        assert _run(engine, [("w", PROMPT, "a")])[0]["ids"] == with_a["ids"]
    finally:
        engine.shutdown()


def test_unloading_while_a_request_runs_lets_it_finish_with_its_adapter(dirs):
    engine = _engine(dirs)
    lora = engine.runner.lora
    try:
        alone = _run(engine, [("alone", PROMPT, "c")])[0]
        done, out = _submit(engine, "running", PROMPT, "c")
        engine.call(lambda: lora.unload("c")).result(60)  # behind the add: the request holds c already
        assert done.wait(300)
        assert out["error"] is None and out["ids"] == alone["ids"]
        assert "not loaded" in _run(engine, [("after", PROMPT, "c")])[0]["error"]
    finally:
        engine.shutdown()
