"""Prometheus metrics, names prefixed `pagedllm:`, each also under vLLM's `vllm:` prefix (the
same families, for dashboards and autoscalers written for vLLM: vllm:num_requests_waiting,
vllm:kv_cache_usage_perc, vllm:time_to_first_token_seconds, ...). One registry per app (no global
state)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedllm.engine.messages import EngineCoreStats
from pagedllm.outputs import RequestOutput
from pagedllm.spec_decode.metrics import METRIC_NAMES, SpecDecodeStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class _EngineCollector:
    """Reads the engine core's last published figures at scrape time."""

    def __init__(self, stats_fn: Callable[[], EngineCoreStats]) -> None:
        self.stats_fn = stats_fn

    def collect(self):
        s = self.stats_fn()
        kv = s.kv
        gauges = {
            "num_requests_running": ("Requests in the running batch", s.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled", s.num_waiting),
            "kv_cache_usage_perc": ("Fraction of KV blocks in use (0-1)", kv.usage),
            "kv_cache_blocks_total": ("KV cache blocks", kv.num_blocks),
            "kv_cache_blocks_free": ("KV cache blocks not in use", kv.num_free_blocks),
            "kv_cache_blocks_cached_free": ("Free blocks still holding reusable prefix-cache K/V",
                                            kv.num_cached_free_blocks),
            "prefix_cache_hit_rate": ("Prefix cache hits / queries, in tokens (0-1)",
                                      kv.prefix_cache_hit_rate),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"pagedllm:{name}", doc, value=value)
        yield GaugeMetricFamily("pagedllm:kv_cache_bytes_per_block",
                                "Bytes one KV block takes, all layers, keys and values (scales included)",
                                value=kv.bytes_per_block)
        pages = GaugeMetricFamily("pagedllm:kv_cache_pages_in_use", "KV pool pages in use, by what they "
                                  "hold (keys and values, or a hybrid model's recurrent states)",
                                  labels=["kind"])
        for kind, count in kv.pages_by_kind.items():
            pages.add_metric([kind], count)
        yield pages
        info = GaugeMetricFamily("pagedllm:kv_cache_info", "What the KV cache stores (value always 1)",
                                 labels=["kv_cache_dtype"])
        info.add_metric([s.kv_cache_dtype], 1)
        yield info
        counters = {
            "num_preemptions": ("Requests preempted for recompute", s.num_preemptions),
            "prompt_tokens": ("Prompt tokens received", s.num_prompt_tokens),
            "generation_tokens": ("Tokens generated", s.num_generation_tokens),
            "prefix_cache_queries": ("Prefix cache queries, in tokens", kv.prefix_cache_queries),
            "prefix_cache_hits": ("Prefix cache hits, in tokens", kv.prefix_cache_hits),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"pagedllm:{name}", doc, value=value)
        if s.spec_decode is not None:
            yield from _spec_decode_counters(s.spec_decode)
        if s.step_share_tokens is not None:
            yield GaugeMetricFamily("pagedllm:step_share_tokens", "Tokens a request of several sequences "
                                    "may add beyond the others' in a shared step (measured or set; 0: off)",
                                    value=s.step_share_tokens)


def _spec_decode_counters(stats: SpecDecodeStats):
    """Speculative decoding's counters, as vLLM names them (pagedllm.spec_decode.metrics)."""
    names = METRIC_NAMES
    yield CounterMetricFamily(names["num_drafts"], "Sequence steps that verified a proposal",
                              value=stats.num_drafts)
    yield CounterMetricFamily(names["num_draft_tokens"], "Proposed tokens verified",
                              value=stats.num_draft_tokens)
    yield CounterMetricFamily(names["num_accepted_tokens"], "Proposed tokens accepted",
                              value=stats.num_accepted_tokens)
    per_pos = CounterMetricFamily(names["num_accepted_tokens_per_pos"], "Proposed tokens accepted, "
                                  "by position in the proposal", labels=["position"])
    for position, count in enumerate(stats.num_accepted_tokens_per_pos):
        per_pos.add_metric([str(position)], count)
    yield per_pos


class ServerMetrics:
    def __init__(self, stats_fn: Callable[[], EngineCoreStats]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats_fn))
        self.vllm_names = CollectorRegistry()
        self.vllm_names.register(_Renamed(self.registry, PREFIX, VLLM_PREFIX))
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
            if m.first_token_time is not None and m.num_output_tokens > 1:
                self.tpot.observe((m.finished_time - m.first_token_time) / (m.num_output_tokens - 1))

    def count_failed_requests(self, failed_fn: Callable[[], int]) -> None:
        """pagedllm:engine_failed_requests_total: requests an engine step failed (a step's lone
        culprits, or every request of a step where none could be pinned)."""
        class _Failed:
            def collect(self):
                yield CounterMetricFamily("pagedllm:engine_failed_requests", "Requests ended by a failed "
                                          "engine step", value=failed_fn())
        self.registry.register(_Failed())

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(self.vllm_names)


PREFIX = "pagedllm:"
VLLM_PREFIX = "vllm:"


class _Renamed:
    """Every family of a registry again, its prefix replaced (the values read at scrape time)."""

    def __init__(self, registry: CollectorRegistry, old: str, new: str) -> None:
        self.registry, self.old, self.new = registry, old, new

    def collect(self):
        for family in self.registry.collect():
            renamed = Metric(self._name(family.name), family.documentation, family.type, family.unit)
            renamed.samples = [sample._replace(name=self._name(sample.name)) for sample in family.samples]
            yield renamed

    def _name(self, name: str) -> str:
        return self.new + name.removeprefix(self.old)
