"""Prometheus metrics, names prefixed `pagedllm:`. One registry per app (no global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagedllm.outputs import RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class _EngineCollector:
    """Reads the engine thread's last published snapshot at scrape time."""

    def __init__(self, snapshot_fn) -> None:
        self.snapshot_fn = snapshot_fn

    def collect(self):
        s = self.snapshot_fn()
        gauges = {
            "num_requests_running": ("Requests in the running batch", s["num_requests_running"]),
            "num_requests_waiting": ("Requests waiting to be scheduled", s["num_requests_waiting"]),
            "kv_cache_usage_perc": ("Fraction of KV blocks in use (0-1)", s.get("usage", 0.0)),
            "kv_cache_blocks_total": ("KV cache blocks", s["num_blocks"]),
            "kv_cache_blocks_free": ("KV cache blocks not in use", s["num_free_blocks"]),
            "kv_cache_blocks_cached_free": ("Free blocks still holding reusable prefix-cache K/V",
                                            s.get("num_cached_free_blocks", 0)),
            "prefix_cache_hit_rate": ("Prefix cache hits / queries, in tokens (0-1)",
                                      s.get("prefix_cache_hit_rate", 0.0)),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"pagedllm:{name}", doc, value=value)
        counters = {
            "num_preemptions": ("Requests preempted for recompute", s.get("num_preemptions", 0)),
            "prompt_tokens": ("Prompt tokens received", s["prompt_tokens_total"]),
            "generation_tokens": ("Tokens generated", s["generation_tokens_total"]),
        }
        for name in ("prefix_cache_queries", "prefix_cache_hits"):
            counters[name] = (f"Prefix cache {name.rsplit('_', 1)[1]}, in tokens", s.get(name, 0))
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"pagedllm:{name}", doc, value=value)


class ServerMetrics:
    def __init__(self, snapshot_fn) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(snapshot_fn))
        self.ttft = Histogram("pagedllm:time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("pagedllm:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("pagedllm:e2e_request_latency_seconds", "Request latency, end to end",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)

    def observe_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
            num_tokens = max(len(o.token_ids) for o in output.outputs)
            if m.first_token_time is not None and num_tokens > 1:
                self.tpot.observe((m.finished_time - m.first_token_time) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
