"""Prometheus metrics for ``GET /metrics``, named after vLLM's with an ``llmkit:`` prefix.

Request metrics are updated from the engine's own events as the server receives them: each
:class:`RequestOutput` (time to first token, inter-token latency, the queue time the engine
measured, carried on the first output), each final output (end-to-end latency, time per output
token, tokens, ``finished_reason``), a request whose stream ends without a final output (an
abort), and each 429. Engine state
(running and waiting requests, KV usage, preemptions, prefix-cache counters) and batch lines are
read from live counters when Prometheus scrapes, through :meth:`EngineClient.stats`, never sampled
from logs. Per token this costs one histogram observation.

Each app has its own :class:`CollectorRegistry` (no process-global state), so several apps in one
process (tests) do not share counters.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llmkit.core.engine.messages import GenerateRequest, RequestOutput

PREFIX = "llmkit:"
FINISH_REASONS = ("stop", "length", "abort")

# vLLM's buckets, so its dashboards' quantiles read the same.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

StatsSource = Callable[[], dict]


class ServerMetrics:
    """The app's metrics. ``sources`` are callables returning counter dicts read at scrape time
    (the engine client's ``stats``, the batch runner's ``line_counts``)."""

    def __init__(self, model_name: str, sources: Iterable[StatsSource] = ()) -> None:
        self.model_name = model_name
        self.sources = list(sources)
        self.registry = CollectorRegistry()
        r, labels, m = self.registry, ["model_name"], model_name

        def hist(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(m)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, labels, registry=r).labels(m)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between successive outputs of a request.", ITL_BUCKETS)
        self.tpot = hist(
            "request_time_per_output_token_seconds",
            "Per request: (end-to-end - time to first token) / (output tokens - 1).",
            ITL_BUCKETS,
        )
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS)
        self.queue = hist(
            "request_queue_time_seconds", "Time waiting in the engine before first scheduled.", LATENCY_BUCKETS
        )
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.gen_len = hist("request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens (aborted requests included).")
        self.aborted = counter("request_aborted", "Requests aborted (client gone, stop button, engine error).")
        self.rejected = counter("request_rejected", "Requests refused with 429 (queue full).")
        self.success = Counter(
            PREFIX + "request_success",
            "Finished requests by finished_reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.finished = {reason: self.success.labels(m, reason) for reason in FINISH_REASONS}
        r.register(_LiveCollector(self))

    def track(self, req: GenerateRequest) -> "RequestTracker":
        return RequestTracker(self, len(req.prompt_ids))

    def on_rejected(self) -> None:
        self.rejected.inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTracker:
    """One engine request's timings, fed its outputs in order; :meth:`close` when its stream ends."""

    __slots__ = ("m", "prompt_tokens", "start", "first", "last", "completion_tokens", "done")

    def __init__(self, metrics: ServerMetrics, prompt_tokens: int) -> None:
        self.m = metrics
        self.prompt_tokens = prompt_tokens
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last = 0.0
        self.completion_tokens = 0
        self.done = False

    def on_output(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        if out.queue_time is not None:  # on the request's first output
            self.m.queue.observe(out.queue_time)
        if out.token_ids:
            if self.first is None:
                self.first = now
                self.m.ttft.observe(now - self.start)
            else:
                self.m.itl.observe(now - self.last)
            self.last = now
            self.completion_tokens = out.completion_tokens
        if out.finished:
            self._finish(out.finish_reason or "abort", out.prompt_tokens, out.completion_tokens, now)

    def close(self) -> None:
        """The stream ended; without a final output the request was aborted (client gone)."""
        if not self.done:
            self._finish("abort", self.prompt_tokens, self.completion_tokens, time.perf_counter())

    def _finish(self, reason: str, prompt_tokens: int, completion_tokens: int, now: float) -> None:
        m = self.m
        self.done = True
        m.e2e.observe(now - self.start)
        if self.first is not None and completion_tokens > 1:
            m.tpot.observe((now - self.first) / (completion_tokens - 1))
        m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(completion_tokens)
        m.prompt_len.observe(prompt_tokens)
        m.gen_len.observe(completion_tokens)
        finished = m.finished.get(reason)
        if finished is None:  # a finish reason a future engine adds
            finished = m.finished[reason] = m.success.labels(m.model_name, reason)
        finished.inc()
        if reason == "abort":
            m.aborted.inc()


# (stats key, metric name, help, kind); engine keys come from EngineClient.stats().
LIVE = (
    ("num_running_reqs", "num_requests_running", "Requests in the running batch.", "gauge"),
    ("num_waiting_reqs", "num_requests_waiting", "Requests waiting to be scheduled.", "gauge"),
    ("token_usage", "kv_cache_usage_perc", "Fraction of KV cache pages in use (1 = full).", "gauge"),
    ("preemptions", "num_preemptions", "Requests preempted for lack of KV pages.", "counter"),
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "counter"),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache.", "counter"),
    ("state_slots_running", "state_slots_running", "Hybrid models: state slots of running requests.", "gauge"),
    (
        "state_snapshots_cached",
        "state_snapshots_cached",
        "Hybrid models: state snapshots the prefix cache holds.",
        "gauge",
    ),
    ("state_snapshots_in_use", "state_snapshots_in_use", "Hybrid models: state snapshot slots in use.", "gauge"),
    # models whose sliding-window layers keep only their window (core/kvcache/window_pages.py)
    ("kv_window_pages_total", "kv_window_pages_total", "Sliding-window layers: pages in their pool.", "gauge"),
    ("kv_window_pages_in_use", "kv_window_pages_in_use", "Sliding-window layers: pages of running requests.", "gauge"),
    (
        "kv_window_pages_cached",
        "kv_window_pages_cached",
        "Sliding-window layers: pages the prefix cache holds.",
        "gauge",
    ),
    ("spec_verify_steps", "spec_decode_num_drafts", "Decode steps of a request that verified a draft.", "counter"),
    ("spec_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens verified.", "counter"),
    ("spec_accepted_tokens", "spec_decode_num_accepted_tokens", "Draft tokens accepted.", "counter"),
    ("tier_write_blocks", "kv_tier_write_blocks", "Blocks of K/V written to the storage tier.", "counter"),
    ("tier_write_bytes", "kv_tier_write_bytes", "Bytes written to the storage tier.", "counter"),
    ("tier_writes_dropped", "kv_tier_writes_dropped", "Blocks not written: queue full or store down.", "counter"),
    ("tier_misses", "kv_tier_misses", "Prefetches that stopped at a block the storage tier lacks.", "counter"),
    ("tier_bad_entries", "kv_tier_bad_entries", "Corrupt, truncated or foreign tier entries (misses).", "counter"),
    ("tier_errors", "kv_tier_errors", "Storage tier reads and writes that failed (store unreachable).", "counter"),
    ("batch_lines_in_flight", "batch_lines_in_flight", "Batch lines handed to the engine.", "gauge"),
    ("batch_lines_queued", "batch_lines_queued", "Batch lines of running batches not yet handed over.", "gauge"),
)


class _LiveCollector:
    """Reads the sources at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics

    def describe(self):
        return []  # names depend on what the sources report

    def collect(self):
        stats: dict = {}
        for source in self.m.sources:
            stats.update(source())
        labels = [self.m.model_name]
        for key, name, doc, kind in LIVE:
            if key not in stats:
                continue
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                PREFIX + name, doc, labels=["model_name"]
            )
            family.add_metric(labels, float(stats[key]))
            yield family
        queries, hits = stats.get("prefix_cache_queries"), stats.get("prefix_cache_hits")
        if queries is not None:
            family = GaugeMetricFamily(
                PREFIX + "prefix_cache_hit_rate",
                "Prompt tokens found in the prefix cache / looked up, since start.",
                labels=["model_name"],
            )
            family.add_metric(labels, hits / queries if queries else 0.0)
            yield family
        if "tier_hit_tokens" in stats:
            yield from _tier_families(stats, labels)
        steps, drafted = stats.get("spec_verify_steps"), stats.get("spec_draft_tokens")
        if steps is not None:  # SGLang's accept length: tokens a verify step emits, on average
            accepted = stats["spec_accepted_tokens"]
            family = GaugeMetricFamily(
                PREFIX + "spec_accept_length",
                "Tokens a speculative verify step emits on average (accepted drafts + 1), since start.",
                labels=["model_name"],
            )
            family.add_metric(labels, (accepted + steps) / steps if steps else 0.0)
            yield family
            family = GaugeMetricFamily(
                PREFIX + "spec_accept_rate", "Draft tokens accepted / verified, since start.", labels=["model_name"]
            )
            family.add_metric(labels, accepted / drafted if drafted else 0.0)
            yield family


def metrics_router(metrics: ServerMetrics):
    """``GET /metrics`` in Prometheus' text format."""
    from fastapi import APIRouter
    from fastapi.responses import Response

    router = APIRouter()

    @router.get("/metrics", include_in_schema=False)
    async def scrape():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return router


def _tier_families(stats: dict, labels: list[str]):
    """Prompt tokens and bytes served by each tier: the device pool (the radix cache's hits less
    what was loaded into it from below) and the storage tier."""
    storage = stats["tier_hit_tokens"]
    device = max(0, stats.get("prefix_cache_hits", 0) - storage)
    hits = CounterMetricFamily(
        PREFIX + "prefix_cache_tier_hits", "Prompt tokens served from each cache tier.", labels=["model_name", "tier"]
    )
    hits.add_metric([*labels, "device"], float(device))
    hits.add_metric([*labels, "storage"], float(storage))
    yield hits
    read = CounterMetricFamily(
        PREFIX + "prefix_cache_tier_bytes", "K/V bytes served from each cache tier.", labels=["model_name", "tier"]
    )
    read.add_metric([*labels, "device"], float(device * stats.get("kv_bytes_per_token", 0)))
    read.add_metric([*labels, "storage"], float(stats.get("tier_read_bytes", 0)))
    yield read
