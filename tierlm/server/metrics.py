"""Prometheus metrics under vLLM's names with a `tierlm:` prefix, in a registry of the server's own.

Latencies and token counts are pushed by the engine thread as outputs leave `step()` (prometheus-client
metrics are thread-safe); the engine's state (running / waiting requests, KV usage, preemptions, prefix
cache) is read at scrape time from the latest `EngineStats` snapshot by a custom collector. Every series
carries a `model_name` label, as vLLM's do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tierlm.engine.llm_engine import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1800.0)


class Metrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        self._ttft = histogram(
            "tierlm:time_to_first_token_seconds", "Arrival to first generated token.", _LATENCY_BUCKETS
        )
        self._itl = histogram(
            "tierlm:inter_token_latency_seconds", "Time between a request's successive tokens.",
            _TOKEN_GAP_BUCKETS,
        )
        self._e2e = histogram(
            "tierlm:e2e_request_latency_seconds", "Arrival to the last token of a finished request.",
            _REQUEST_BUCKETS,
        )
        self._prompt_tokens = counter("tierlm:prompt_tokens", "Prompt tokens (counted at first token).")
        self._generation_tokens = counter("tierlm:generation_tokens", "Generated tokens.")
        self._success = Counter(
            "tierlm:request_success", "Requests finished by the engine (aborted ones are not).",
            ["model_name", "finished_reason"], registry=self.registry,
        )
        self._throttled = Gauge(
            "tierlm:num_streams_throttled", "Streams paused because their client has not read their output.",
            labels, registry=self.registry,
        ).labels(model_name)
        self._stalled = counter(
            "tierlm:streams_ended_stalled", "Streams ended because their client read nothing for the stall timeout."
        )
        self._model_name = model_name
        self.registry.register(_EngineStatsCollector(model_name, stats))

    # ---- pushed by the engine thread ---------------------------------------------------------------
    def first_token(self, seconds: float, num_prompt_tokens: int) -> None:
        self._ttft.observe(seconds)
        self._prompt_tokens.inc(num_prompt_tokens)

    def next_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def generated(self, num_tokens: int) -> None:
        self._generation_tokens.inc(num_tokens)

    def finished(self, seconds: float, finish_reasons: Iterable[str | None]) -> None:
        self._e2e.observe(seconds)
        for reason in finish_reasons:
            self._success.labels(self._model_name, reason).inc()

    def throttled(self, num_streams: int) -> None:
        self._throttled.set(num_streams)

    def stalled(self) -> None:
        self._stalled.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineStatsCollector(Collector):
    """Engine state as gauges and counters, read from the latest stats snapshot at each scrape."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        stats = self._stats()
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        values = [
            (gauge, "tierlm:num_requests_running", "Requests in the running batch.", stats.num_running),
            (gauge, "tierlm:num_requests_waiting", "Requests waiting to be admitted.", stats.num_waiting),
            (gauge, "tierlm:kv_cache_usage_perc", "Fraction of K/V blocks in use.", stats.kv_cache_usage),
            (counter, "tierlm:num_preemptions", "Preemptions since start.", stats.num_preemptions),
            (counter, "tierlm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats.prefix_cache_queries),
            (counter, "tierlm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             stats.prefix_cache_hits),
            # the PLE n-gram tables as memory-mapped files (all zero when they are in memory)
            (counter, "tierlm:ple_rows_gathered", "PLE table rows gathered from the mapped files.",
             stats.ple_rows_gathered),
            (counter, "tierlm:ple_pages_advised", "Table pages asked for with MADV_WILLNEED.", stats.ple_pages_advised),
            (gauge, "tierlm:ple_prefetch_backlog_tokens", "Admitted prompt tokens whose pages are not advised yet.",
             stats.ple_prefetch_backlog_tokens),
            (counter, "tierlm:ple_gather_seconds", "Time spent inside PLE gathers (page faults included).",
             stats.ple_gather_seconds),
            (gauge, "tierlm:ple_table_resident_fraction", "Share of table pages in memory (sampled with mincore).",
             stats.ple_table_resident_fraction),
            (counter, "tierlm:qsa_row_cache_hits", "Decode K/V row reads served from the VRAM row cache.",
             stats.qsa_row_cache_hits),
            (counter, "tierlm:qsa_row_cache_misses", "Decode K/V row reads from the host pools.",
             stats.qsa_row_cache_misses),
            (gauge, "tierlm:device_memory_allocated_bytes", "Device memory held by tensors (0 on CPU).",
             stats.device_memory_allocated),
            (gauge, "tierlm:device_memory_reserved_bytes", "Device memory reserved by the caching allocator.",
             stats.device_memory_reserved),
            (gauge, "tierlm:device_memory_peak_bytes", "The most device memory tensors have held since start.",
             stats.device_memory_peak),
            # speculative decoding (vLLM's names; zeros without --speculative-config)
            (counter, "tierlm:spec_decode_num_drafts", "Verify steps of requests that carried drafts.",
             stats.num_drafts),
            (counter, "tierlm:spec_decode_num_draft_tokens", "Draft tokens verified.", stats.num_draft_tokens),
            (counter, "tierlm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.num_accepted_tokens),
            (gauge, "tierlm:qsa_row_cache_hit_rate", ("Share of decode K/V row reads served by the row cache, "
             "since start (0 before any)."), _share(stats.qsa_row_cache_hits, stats.qsa_row_cache_misses)),
        ]
        for family, name, doc, value in values:
            metric = family(name, doc, labels=["model_name"])
            metric.add_metric([self._model_name], value)
            yield metric
        if stats.num_accepted_tokens_per_pos:  # with --speculative-config: one series per draft position
            metric = counter("tierlm:spec_decode_num_accepted_tokens_per_pos",
                             "Drafts accepted at each draft position (0: the first draft).",
                             labels=["model_name", "position"])
            for position, value in enumerate(stats.num_accepted_tokens_per_pos):
                metric.add_metric([self._model_name, str(position)], value)
            yield metric


def _share(hits: int, misses: int) -> float:
    return hits / (hits + misses) if hits + misses else 0.0
