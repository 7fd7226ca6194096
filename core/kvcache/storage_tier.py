"""The storage tier below the radix cache (SGLang's HiCache storage layer, on any device).

Writes (``--hicache-write-policy write_through``): when a request leaves, the whole blocks of its
cached K/V that the tier does not hold yet are queued for the writer thread, their radix nodes
locked so the pages cannot be reused before they are read. The queue is bounded: when it is full
the write is dropped (counted), never waited for. The writer unlocks through :meth:`poll`, which
the engine calls each step (the tree belongs to the engine thread).

Reads: when a request arrives, the blocks after its device-cached prefix are fetched by the reader
thread while it waits in the queue (:meth:`prefetch`); it is admitted once they are in, or after
``--hicache-prefetch-timeout`` with what came by then. At admission (:meth:`load`) they are copied
into fresh pages and inserted into the radix cache, so the request (and every later one) matches
them as any cached prefix: ``cached_tokens`` counts them.

Every failure of the store is a logged miss; after one the store is left alone for
``RETRY_AFTER_S``, so a store that is down costs requests nothing.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from llmkit.core.kvcache import tier_entry
from llmkit.core.kvcache.kv_pool import FP8_DTYPES, KVCachePool
from llmkit.core.kvcache.kv_storage import KVStorage
from llmkit.core.kvcache.prefix_cache import PrefixCache
from llmkit.core.kvcache.tier_keys import block_keys, tier_seed

log = logging.getLogger("llmkit")

BLOCK_TOKENS = 64  # tokens an entry holds (rounded up to whole pages): big enough for few round trips
RETRY_AFTER_S = 5.0  # a failing store is skipped this long before it is tried again
WRITE_QUEUE = 64  # writes queued at most; more are dropped
READERS = 4  # reader threads (the store's calls release the GIL: network or disk)
_KNOWN_MAX = 1 << 20  # keys remembered as stored (then forgotten: at worst an entry is checked again)


def tier_block(page_size: int) -> int:
    return page_size * -(-BLOCK_TOKENS // page_size)


@dataclass
class _Prefetch:
    ids: list[int]
    namespace: str
    first_block: int
    since: float = field(default_factory=time.monotonic)
    blocks: list = field(default_factory=list)  # each: one tensor a buffer, appended by the reader
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False


@dataclass
class _Write:
    keys: list[bytes]
    todo: list[int]  # the block indices to write
    slots: torch.Tensor | None  # where to read them (write_through; the nodes are locked)
    handle: object
    rows: list | None = None  # or their rows, copied out already (write_back: the pages are gone)


class StorageTier:
    """The tier over ``store`` for ``pool`` and ``cache``; ``model``: the seed parts every entry
    of this server shares (``tier_keys.tier_seed``)."""

    def __init__(
        self,
        store: KVStorage,
        pool: KVCachePool,
        cache: PrefixCache,
        model: dict,
        name: str,
        prefetch_timeout: float,
        write_policy: str = "write_through",
    ) -> None:
        self.store, self.pool, self.cache, self.name = store, pool, cache, name
        self.block = tier_block(pool.page_size)
        self.model = {**model, "block": self.block, "kv_dtype": str(pool.dtype), "layout": self._layout(pool)}
        self.prefetch_timeout = prefetch_timeout
        self.write_back = write_policy == "write_back"
        self._namespaces: dict[int, str] = {}  # write_back: a radix namespace's tier namespace
        if self.write_back:
            cache.on_evict = self._evicting
        self._seeds: dict[str, bytes] = {}
        self._known: set[bytes] = set()
        self._prefetches: dict[str, _Prefetch] = {}
        # (several: one large prefix being read must not hold up the next request's lookup)
        self._reader = ThreadPoolExecutor(READERS, thread_name_prefix="llmkit-tier-read")
        self._writes: queue.Queue = queue.Queue(WRITE_QUEUE)
        self._written: collections.deque = collections.deque()  # handles the writer is done with
        self._down_until = 0.0
        self.counters = collections.Counter()
        self._count_lock = threading.Lock()
        self._writer = threading.Thread(target=self._write_loop, name="llmkit-tier-write", daemon=True)
        self._writer.start()

    @staticmethod
    def _layout(pool: KVCachePool) -> list:
        return [list(b.shape[1:]) for b in pool.k_buffers + pool.v_buffers]

    def _seed(self, namespace: str) -> bytes:
        seed = self._seeds.get(namespace)
        if seed is None:
            seed = self._seeds[namespace] = tier_seed(self.model, namespace)
        return seed

    # -- reads (engine thread: prefetch, ready, load, forget) ------------------------------------
    def prefetch(self, rid: str, ids: list[int], namespace: str, cache_namespace: int) -> None:
        """Start fetching the blocks of ``ids`` after its device-cached prefix."""
        cached = len(self.cache.match_prefix(ids, cache_namespace)[0])
        first = cached // self.block
        if (first + 1) * self.block > len(ids):
            return  # no whole block beyond what the device holds
        job = self._prefetches[rid] = _Prefetch(ids, namespace, first)
        self._reader.submit(self._fetch, job)

    def ready(self, rid: str) -> bool:
        """Whether ``rid`` may be admitted: its fetch is over (or timed out, or there is none)."""
        job = self._prefetches.get(rid)
        return job is None or job.done.is_set() or time.monotonic() - job.since >= self.prefetch_timeout

    def wait_briefly(self, seconds: float = 0.005) -> None:
        """Nothing else to do: let a prefetch finish instead of spinning."""
        for job in self._prefetches.values():
            if not job.done.is_set():
                job.done.wait(seconds)
                return

    def forget(self, rid: str) -> None:
        job = self._prefetches.pop(rid, None)
        if job is not None:
            job.cancelled = True

    def load(self, rid: str, ids: list[int], cache_namespace: int) -> int:
        """Put what was fetched for ``rid`` into the pool and the radix cache; the tokens loaded."""
        job = self._prefetches.pop(rid, None)
        if job is None:
            return 0
        job.cancelled = True
        blocks = list(job.blocks)
        dev_slots, handle = self.cache.match_prefix(ids, cache_namespace)
        have, start = len(dev_slots), job.first_block * self.block
        end = start + len(blocks) * self.block
        if not blocks or have < start or end <= have:
            return 0  # the device prefix changed since: what was fetched no longer continues it
        self.cache.lock(handle)  # (the eviction below must not take the prefix it continues)
        try:
            need = (end - have) // self.pool.page_size
            if need > self.pool.num_free_pages:
                self.cache.evict(need - self.pool.num_free_pages)
            pages = self.pool.allocate(need)
        finally:
            self.cache.unlock(handle)
        if pages is None:
            self._count("tier_load_no_pages", 1)
            return 0
        slots = self.pool.page_slots(pages)
        skip = have - start
        for i, buf in enumerate(self.pool.k_buffers + self.pool.v_buffers):
            rows = torch.cat([b[i] for b in blocks])[skip:].to(buf.device)
            index = slots.to(buf.device)
            if buf.dtype in FP8_DTYPES:  # (no CPU index_copy_ kernel for fp8: copy the bytes)
                buf.view(torch.uint8).index_copy_(0, index, rows.view(torch.uint8))
            else:
                buf.index_copy_(0, index, rows)
        already = self.cache.insert(ids[:end], torch.cat([dev_slots, slots]), cache_namespace)
        if already > have:  # (cannot happen on the engine thread; the duplicates go back)
            self.pool.free(pages[: (already - have) // self.pool.page_size])
        self._count("tier_hit_tokens", end - already)
        return end - already

    def _fetch(self, job: _Prefetch) -> None:
        """Reader thread: fetch blocks from ``job.first_block`` on until one is missing or bad."""
        try:
            if time.monotonic() < self._down_until:
                return
            keys = block_keys(self._seed(job.namespace), job.ids, self.block)
            like = [torch.empty((self.block, *b.shape[1:]), dtype=b.dtype, device="meta") for b in self._buffers()]
            for key in keys[job.first_block :]:
                if job.cancelled or time.monotonic() - job.since >= self.prefetch_timeout:
                    return
                blob = self.store.get(key.hex())
                if blob is None:
                    self._count("tier_misses", 1)
                    return
                tensors, why = tier_entry.decode(key, blob, like)
                if tensors is None:
                    self._count(f"tier_bad_{why}", 1)
                    log.warning("KV storage tier (%s): entry %s is %s: a miss", self.name, key.hex()[:16], why)
                    return
                self._count("tier_read_bytes", len(blob))
                self._count("tier_hit_blocks", 1)
                self._remember(key)
                job.blocks.append(tensors)
        except Exception as exc:  # noqa: BLE001 (a failing store is a miss, never a failed request)
            self._failed("read", exc)
        finally:
            job.done.set()

    def _buffers(self) -> list[torch.Tensor]:
        return self.pool.k_buffers + self.pool.v_buffers

    # -- writes ------------------------------------------------------------------------------
    def store_prefix(self, ids: list[int], namespace: str, cache_namespace: int) -> None:
        """Engine thread, after ``ids`` went into the radix cache: queue its new whole blocks
        (write_back: note its namespace; its blocks go when evicted)."""
        if self.write_back:
            self._namespaces[cache_namespace] = namespace
            return
        n = len(ids) - len(ids) % self.block
        if not n:
            return
        keys = block_keys(self._seed(namespace), ids[:n], self.block)
        todo = [i for i, k in enumerate(keys) if k not in self._known]
        if not todo:
            return
        if self._writes.full() or time.monotonic() < self._down_until:
            self._count("tier_writes_dropped", len(todo))
            return
        slots, handle = self.cache.match_prefix(ids[:n], cache_namespace)
        todo = [i for i in todo if (i + 1) * self.block <= len(slots)]
        if not todo:
            return
        self.cache.lock(handle)
        self._writes.put_nowait(_Write(keys, todo, slots, handle))

    def _evicting(self, node) -> None:
        """Engine thread, write_back: ``node`` (a leaf) is about to be freed. Copy out the whole
        blocks that end in it (those before are written when their own nodes go) and queue them."""
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        namespace = self._namespaces.get(self.cache.namespace_of(node))
        if namespace is None:  # (an adapter's prefix: not stored)
            return
        ids = [t for n in reversed(path) for t in n.key]
        start, end = len(ids) - len(path[0].key), len(ids) - len(ids) % self.block
        keys = block_keys(self._seed(namespace), ids[:end], self.block)
        todo = [i for i in range(start // self.block, len(keys)) if keys[i] not in self._known]
        if not todo:
            return
        if self._writes.full() or time.monotonic() < self._down_until:
            self._count("tier_writes_dropped", len(todo))
            return
        slots = torch.cat([n.slots for n in reversed(path)])
        index = torch.cat([slots[i * self.block : (i + 1) * self.block] for i in todo])
        rows = [_gather(b, index.to(b.device)).cpu() for b in self._buffers()]  # (a copy: the pages go now)
        self._writes.put_nowait(_Write(keys, todo, None, None, rows))

    def poll(self) -> None:
        """Engine thread: unlock the prefixes the writer has read."""
        while self._written:
            self.cache.unlock(self._written.popleft())

    def _write_loop(self) -> None:
        while True:
            job = self._writes.get()
            if job is None:
                self._writes.task_done()
                return
            try:
                self._write(job)
            finally:
                if job.handle is not None:
                    self._written.append(job.handle)
                self._writes.task_done()

    def _write(self, job: _Write) -> None:
        try:
            for i in job.todo:
                key = job.keys[i]
                if time.monotonic() < self._down_until:
                    self._count("tier_writes_dropped", 1)
                    continue
                hexkey = key.hex()
                if not self.store.exists(hexkey):
                    if job.rows is not None:  # (the todo blocks' rows, one after another)
                        at = job.todo.index(i) * self.block
                        rows = [r[at : at + self.block] for r in job.rows]
                    else:
                        index = job.slots[i * self.block : (i + 1) * self.block]
                        rows = [_gather(b, index.to(b.device)).cpu() for b in self._buffers()]
                    blob = tier_entry.encode(key, rows)
                    self.store.put(hexkey, blob)
                    self._count("tier_write_bytes", len(blob))
                    self._count("tier_write_blocks", 1)
                self._remember(key)
        except Exception as exc:  # noqa: BLE001 (a failing store drops the write, logged)
            self._failed("write", exc)

    def _count(self, name: str, n: int) -> None:
        with self._count_lock:  # (the reader threads, the writer and the engine all count)
            self.counters[name] += n

    def _remember(self, key: bytes) -> None:
        if len(self._known) >= _KNOWN_MAX:
            self._known.clear()
        self._known.add(key)

    def _failed(self, what: str, exc: Exception) -> None:
        self._count(f"tier_{what}_errors", 1)
        if time.monotonic() >= self._down_until:
            log.warning(
                "KV storage tier (%s) unreachable on %s: %s: %s; serving without it for %.0f s",
                self.name,
                what,
                type(exc).__name__,
                exc,
                RETRY_AFTER_S,
            )
        self._down_until = time.monotonic() + RETRY_AFTER_S

    # -- shutdown ----------------------------------------------------------------------------
    def flush(self, timeout: float = 30.0) -> bool:
        """Wait (up to ``timeout``) until the queued writes are done; whether they are."""
        deadline = time.monotonic() + timeout
        while self._writes.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._writes.unfinished_tasks

    def close(self, timeout: float = 10.0) -> None:
        """Finish the queued writes (a restart finds them), then stop the threads. write_back:
        the engine has stopped, so its cached prefixes are written now, or lost."""
        if self.write_back:
            self._writes.maxsize = 0  # (unbounded: shutdown waits for them, within the timeout)
            self.poll()
            self.cache.evict(self.cache.evictable_pages)
        try:
            self._writes.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._writer.join(timeout)
        self._reader.shutdown(wait=False, cancel_futures=True)
        self.store.close()

    def stats(self) -> dict:
        c = self.counters
        return {
            "kv_tier_backend": self.name,
            "kv_bytes_per_token": self.pool.bytes_per_token(),
            **{k: int(c[k]) for k in _COUNTERS},
            "tier_bad_entries": sum(v for k, v in c.items() if k.startswith("tier_bad_")),
            "tier_errors": c["tier_read_errors"] + c["tier_write_errors"],
            **{k: int(v) for k, v in c.items() if k.startswith("tier_bad_")},
        }


# Reported from the start (as 0), so /metrics has every series before the first event.
_COUNTERS = (
    "tier_hit_tokens",
    "tier_hit_blocks",
    "tier_read_bytes",
    "tier_misses",
    "tier_read_errors",
    "tier_write_blocks",
    "tier_write_bytes",
    "tier_writes_dropped",
    "tier_write_errors",
    "tier_load_no_pages",
)


def _gather(buf: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if buf.dtype in FP8_DTYPES:  # (no CPU gather kernel for fp8: its bytes)
        return buf.view(torch.uint8).index_select(0, index).view(buf.dtype)
    return buf.index_select(0, index)
