"""The storage tier on a KV pool without a model: blocks written through and loaded back bit for
bit, and every bad entry or unreachable store a miss, never an error or a wait."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
import torch

from llmkit.core.kvcache.tier_keys import block_keys, tier_seed
from llmkit.plugins.kv_storage.file import FileKVStorage
from llmkit.plugins.kv_storage.redis import RedisKVStorage
from llmkit.plugins.kv_storage.s3 import S3KVStorage

from s3_utils import make_bucket, moto_endpoint
from server_utils import free_port
from tier_utils import MODEL, compute, fetch, make_tier, rows, start_redis

IDS = list(range(100, 100 + 200))  # 3 whole blocks of 64 (and 8 tokens over)


def _write(store, ids=IDS, dtype=torch.float32, model=MODEL, namespace=""):
    pool, cache, tier = make_tier(store, dtype=dtype, model=model)
    slots = compute(pool, cache, ids)
    tier.store_prefix(ids, namespace, 0)
    assert tier.flush()
    tier.poll()
    assert cache.evictable_pages == cache.cached_pages  # the writer let go of every page
    return rows(pool, slots[:192]), tier


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_blocks_come_back_bit_for_bit(tmp_path, dtype):
    want, writer = _write(FileKVStorage(path=str(tmp_path)), dtype=dtype)
    assert writer.counters["tier_write_blocks"] == 3
    pool, cache, tier = make_tier(FileKVStorage(path=str(tmp_path)), dtype=dtype)
    assert fetch(tier, IDS[:-1]) == 192
    slots, _ = cache.match_prefix(IDS[:-1])
    assert len(slots) == 192
    assert all(torch.equal(a, b) for a, b in zip(rows(pool, slots), want))
    assert tier.stats()["tier_hit_tokens"] == 192


def test_a_device_prefix_is_continued_from_the_tier(tmp_path):
    want, _ = _write(FileKVStorage(path=str(tmp_path)))
    pool, cache, tier = make_tier(FileKVStorage(path=str(tmp_path)))
    compute(pool, cache, IDS[:80], seed=0)  # the device holds 5 pages: the tier adds the rest
    assert fetch(tier, IDS[:-1]) == 192 - 80
    slots, _ = cache.match_prefix(IDS[:-1])
    assert all(torch.equal(a[80:], b[80:]) for a, b in zip(rows(pool, slots), want))


def test_write_back_writes_blocks_as_they_are_evicted_and_at_shutdown(tmp_path):
    pool, cache, tier = make_tier(FileKVStorage(path=str(tmp_path)), policy="write_back")
    slots = compute(pool, cache, IDS)
    want = rows(pool, slots[:192])
    tier.store_prefix(IDS, "", 0)  # (notes the namespace only)
    compute(pool, cache, [7] + IDS[1:], seed=1)  # another prefix, used later
    assert tier.flush() and tier.counters["tier_write_blocks"] == 0
    assert cache.evict(1) == 12  # the least recently used leaf: IDS's 192 tokens, 3 blocks
    assert tier.flush() and tier.counters["tier_write_blocks"] == 3
    tier.close()  # writes what is still cached
    assert tier.counters["tier_write_blocks"] == 6
    pool, cache, reader = make_tier(FileKVStorage(path=str(tmp_path)))
    assert fetch(reader, IDS[:-1]) == 192
    assert all(torch.equal(a, b) for a, b in zip(rows(pool, cache.match_prefix(IDS[:-1])[0]), want))


def test_written_blocks_are_not_written_again(tmp_path):
    _, tier = _write(FileKVStorage(path=str(tmp_path)))
    tier.store_prefix(IDS, "", 0)  # known: nothing queued
    assert tier.flush() and tier.counters["tier_write_blocks"] == 3


def _entry_paths(root: Path, ids=IDS, model=MODEL, namespace=""):
    keys = block_keys(tier_seed({**model, **_shape_parts()}, namespace), ids, 64)
    return [root / k.hex()[:2] / k.hex() for k in keys]


def _shape_parts():
    return {"block": 64, "kv_dtype": "torch.float32", "layout": [[2, 4]] * 4}


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "foreign"])
def test_a_bad_entry_is_a_logged_miss(tmp_path, damage, caplog):
    _write(FileKVStorage(path=str(tmp_path)))
    paths = _entry_paths(tmp_path)
    assert all(p.exists() for p in paths)
    second = paths[1]
    if damage == "corrupt":
        data = bytearray(second.read_bytes())
        data[len(data) // 2] ^= 0x40
        second.write_bytes(bytes(data))
    elif damage == "truncated":
        second.write_bytes(second.read_bytes()[:-100])
    else:  # block 0's entry under block 1's key
        second.write_bytes(paths[0].read_bytes())
    pool, cache, tier = make_tier(FileKVStorage(path=str(tmp_path)))
    assert fetch(tier, IDS[:-1]) == 64  # the blocks before it only
    assert tier.counters[f"tier_bad_{damage}"] == 1
    assert damage in caplog.text


def test_another_models_or_owners_entries_are_never_looked_up(tmp_path):
    _write(FileKVStorage(path=str(tmp_path)))
    for model, namespace in [({**MODEL, "weights": "w1"}, ""), (MODEL, "salt:bob")]:
        _, _, tier = make_tier(FileKVStorage(path=str(tmp_path)), model=model)
        assert fetch(tier, IDS[:-1], namespace=namespace) == 0
        assert tier.counters["tier_misses"] == 1


def test_a_store_that_is_down_costs_nothing(caplog):
    port = free_port()  # nothing listens there
    pool, cache, tier = make_tier(RedisKVStorage(url=f"redis://127.0.0.1:{port}", timeout=0.5))
    t0 = time.monotonic()
    assert fetch(tier, IDS[:-1]) == 0
    compute(pool, cache, IDS)
    tier.store_prefix(IDS, "", 0)  # dropped at once: the store is left alone for a while
    assert time.monotonic() - t0 < 2
    assert tier.flush(5)
    tier.poll()
    assert cache.evictable_pages == cache.cached_pages
    assert tier.counters["tier_read_errors"] == 1 and tier.counters["tier_writes_dropped"] == 3
    assert "unreachable" in caplog.text


class _SlowStore(FileKVStorage):
    """A store that answers each read after ``delay`` seconds (a congested network share)."""

    delay = 1.0

    def get(self, key):
        time.sleep(self.delay)
        return super().get(key)


def test_a_slow_store_delays_a_request_only_until_the_prefetch_timeout(tmp_path):
    _write(FileKVStorage(path=str(tmp_path)))
    _, _, tier = make_tier(_SlowStore(path=str(tmp_path)), timeout=0.3)
    t0 = time.monotonic()
    tier.prefetch("r", IDS[:-1], "", 0)
    assert not tier.ready("r")
    while not tier.ready("r"):
        time.sleep(0.01)
    assert 0.3 <= time.monotonic() - t0 < 0.9
    assert tier.load("r", IDS[:-1], 0) == 0  # nothing had arrived: computed instead


class _BlockedStore(FileKVStorage):
    """A store whose writes hang until ``release`` is set."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.release = threading.Event()

    def put(self, key, data):
        self.release.wait(30)
        super().put(key, data)


def test_a_full_write_queue_drops_writes_instead_of_waiting(tmp_path):
    store = _BlockedStore(path=str(tmp_path))
    pool, cache, tier = make_tier(store, pages=4096)
    t0 = time.monotonic()
    for i in range(80):  # more prefixes than the queue holds
        ids = [i * 1000 + j for j in range(64)]
        compute(pool, cache, ids, seed=i)
        tier.store_prefix(ids, "", 0)
    assert time.monotonic() - t0 < 5
    assert tier.counters["tier_writes_dropped"] > 0
    store.release.set()
    assert tier.flush()
    tier.poll()
    assert cache.evictable_pages == cache.cached_pages  # every lock the writes took is given back


def test_a_full_disk_drops_the_write_and_leaves_no_partial_file(tmp_path, caplog):
    import resource
    import signal

    store = FileKVStorage(path=str(tmp_path))
    pool, cache, tier = make_tier(store)
    compute(pool, cache, IDS)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, old_limit[1]))  # an entry is ~4 kB
    try:
        tier.store_prefix(IDS, "", 0)
        assert tier.flush()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    tier.poll()
    assert tier.counters["tier_write_errors"] == 1
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
    assert "unreachable on write" in caplog.text


@pytest.fixture(scope="module")
def redis_url():
    port = free_port()
    proc = start_redis(port)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


def test_redis_round_trip(redis_url):
    want, writer = _write(RedisKVStorage(url=redis_url))
    assert writer.counters["tier_write_blocks"] == 3
    pool, cache, tier = make_tier(RedisKVStorage(url=redis_url))
    assert fetch(tier, IDS[:-1]) == 192
    slots, _ = cache.match_prefix(IDS[:-1])
    assert all(torch.equal(a, b) for a, b in zip(rows(pool, slots), want))
    store = RedisKVStorage(url=redis_url, key_prefix="other:")
    assert store.get("0" * 64) is None and not store.exists("0" * 64)
    store.put("0" * 64, b"x" * 100_000)
    assert store.get("0" * 64) == b"x" * 100_000


def test_s3_round_trip():
    with moto_endpoint() as endpoint:
        make_bucket(endpoint, "kv-tier")

        def store(prefix="llmkit/kv/"):
            return S3KVStorage(bucket="kv-tier", prefix=prefix, endpoint_url=endpoint, region="us-east-1")

        want, writer = _write(store())
        assert writer.counters["tier_write_blocks"] == 3
        pool, cache, tier = make_tier(store())
        assert fetch(tier, IDS[:-1]) == 192
        slots, _ = cache.match_prefix(IDS[:-1])
        assert all(torch.equal(a, b) for a, b in zip(rows(pool, slots), want))
        _, _, other = make_tier(store("elsewhere/"))  # another prefix: nothing there
        assert fetch(other, IDS[:-1]) == 0 and other.counters["tier_misses"] == 1


def test_a_third_party_backend_is_a_small_module(tmp_path, monkeypatch):
    """The toy plugin's flat-file backend (tests/plugins/llmkit_toy) serves the tier as it is."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "plugins" / "llmkit_toy"))
    from llmkit_toy.kv_storage import FlatKVStorage

    want, _ = _write(FlatKVStorage(path=str(tmp_path)))
    pool, cache, tier = make_tier(FlatKVStorage(path=str(tmp_path)))
    assert fetch(tier, IDS[:-1]) == 192
    assert all(torch.equal(a, b) for a, b in zip(rows(pool, cache.match_prefix(IDS[:-1])[0]), want))


@pytest.mark.parametrize(
    "engine, error",
    [
        (dict(enable_hierarchical_cache=True, disable_radix_cache=True), "drop --disable-radix-cache"),
        (dict(hicache_storage_backend="file", tp_size=2), "--tp-size > 1"),
        (dict(hicache_storage_backend="nope"), "valid: file, redis, s3"),
        (dict(enable_hierarchical_cache=True, hicache_storage_backend_extra_config="[1]"), "a JSON object"),
    ],
)
def test_what_the_tier_is_not_served_with_is_refused_before_the_model_loads(engine, error):
    from llmkit.core.engine.config import EngineConfig
    from llmkit.core.option import OptionError
    from llmkit.core.refusals import check_configs
    from llmkit.core.server.config import ServerConfig

    with pytest.raises(OptionError, match=re.escape(error)):
        check_configs(EngineConfig(device="cpu", **engine), ServerConfig(), listening=False)
