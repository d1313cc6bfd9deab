"""Prometheus metrics, names prefixed `pagedllm:`, each also under vLLM's `vllm:` prefix (the
same families, for dashboards and autoscalers written for vLLM: vllm:num_requests_waiting,
vllm:kv_cache_usage_perc, vllm:time_to_first_token_seconds, ...). One registry per app (no global
state).

The families vLLM's own metrics test expects are all here, each measuring what its name says on
this engine:
- per request, when it finishes: prompt tokens, the time waiting (arrival to first scheduled),
  running (first scheduled to finished), in prefill (first scheduled to first token) and decode
  (first token to finished), its preemptions; a generation request's generated tokens and
  request_success by finish reason, one per sequence (vLLM runs each of n's sequences as a
  request of its own);
- per request, when the core takes it: its n and max_tokens (the room left when it gave none);
- per step report: inter_token_latency, the time since the request's previous step that brought
  it tokens (one interval per step, however many tokens a speculative step brought), and
  iteration_tokens_total, the tokens the model computed in the step (prefill chunks and decodes;
  vLLM counts the prompt tokens scheduled plus the tokens sampled);
- num_requests_waiting_by_reason: every waiting request under "capacity" (this scheduler defers
  none for other reasons); admission_rejections_total: requests refused by --max-waiting-requests
  (vLLM's reason max_num_queued_reqs); cache_config_info: the KV cache's settings as labels
  (its token slots, kv_cache_size_tokens, and the requests max_model_len long it holds at once,
  kv_cache_max_concurrency, among them).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedllm.engine.core_channel import StepReport
from pagedllm.engine.messages import EngineCoreRequest, EngineCoreStats
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.spec_decode.metrics import METRIC_NAMES, SpecDecodeStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_COUNT_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)  # n, preemptions
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class _EngineCollector:
    """Reads the engine core's last published figures at scrape time."""

    def __init__(self, stats_fn: Callable[[], EngineCoreStats], prefix_caching: bool,
                 max_concurrency: int) -> None:
        self.stats_fn = stats_fn
        self.prefix_caching = prefix_caching
        self.max_concurrency = max_concurrency

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
        by_reason = GaugeMetricFamily("pagedllm:num_requests_waiting_by_reason", "Requests waiting to be "
                                      "scheduled, by why: all wait for capacity here", labels=["reason"])
        by_reason.add_metric(["capacity"], s.num_waiting)
        yield by_reason
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
        labels = ["block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks",
                  "kv_cache_size_tokens", "kv_cache_max_concurrency"]
        config = GaugeMetricFamily("pagedllm:cache_config_info", "The KV cache's settings (value always 1)",
                                   labels=labels)
        config.add_metric([str(kv.block_size), s.kv_cache_dtype, str(self.prefix_caching), str(kv.num_blocks),
                           str(kv.num_blocks * kv.block_size), str(self.max_concurrency)], 1)
        yield config
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
    def __init__(self, stats_fn: Callable[[], EngineCoreStats], prefix_caching: bool = True,
                 max_model_len: int = 2**16, max_concurrency: int = 0) -> None:
        """max_concurrency: requests max_model_len long the KV cache holds at once."""
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats_fn, prefix_caching, max_concurrency))
        self.vllm_names = CollectorRegistry()
        self.vllm_names.register(_Renamed(self.registry, PREFIX, VLLM_PREFIX))
        token_buckets = _token_buckets(max_model_len)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"pagedllm:{name}", doc, buckets=buckets, registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Mean time per output token after the first, per request", _TPOT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two steps that brought a "
                             "request tokens", _TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, end to end", _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time from arrival to first scheduled",
                                    _LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "Time from first scheduled "
                                        "to finished", _LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Time from first scheduled to "
                                      "first token", _LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "Time from first token to finished",
                                     _LATENCY_BUCKETS)
        self.preemptions = histogram("request_num_preemptions", "Times a request's sequences were "
                                     "preempted", _COUNT_BUCKETS)
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request", token_buckets)
        self.generation_tokens = histogram("request_generation_tokens", "Tokens generated per request, "
                                           "all its sequences", token_buckets)
        self.params_n = histogram("request_params_n", "The n of each request", _COUNT_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens", "The max_tokens of each request "
                                           "(the room left in the context when it gave none)", token_buckets)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens the model computed per step "
                                          "(prefill chunks and decodes)", token_buckets)
        self.success = Counter("pagedllm:request_success", "Sequences finished, by finish reason",
                               ["finished_reason"], registry=self.registry)
        self._last_tokens_at: dict[str, float] = {}  # request id -> its last step with tokens
        self._computed_tokens = stats_fn().num_computed_tokens

    def observe_added(self, request: EngineCoreRequest) -> None:
        """A generation request the core took: its parameters."""
        params = request.sampling_params
        if request.pooling is None:
            self.params_n.observe(params.n)
            if params.max_tokens is not None:  # the input processor fits it; offline callers may not
                self.params_max_tokens.observe(params.max_tokens)

    def observe_report(self, report: StepReport, is_running: Callable[[str], bool]) -> None:
        """A step's report: its computed tokens and each request's interval since its last tokens.
        is_running: whether a request id is still unfinished (the others are forgotten)."""
        computed = report.stats.num_computed_tokens
        if computed > self._computed_tokens:
            self.iteration_tokens.observe(computed - self._computed_tokens)
        self._computed_tokens = computed
        now = time.monotonic()
        last = self._last_tokens_at
        for request_id in {output.request_id for output in report.outputs if output.new_token_ids}:
            if request_id in last:
                self.itl.observe(now - last[request_id])
            last[request_id] = now
        for request_id in [r for r in last if not is_running(r)]:
            del last[request_id]

    def observe_finished(self, output: RequestOutput | PoolingRequestOutput) -> None:
        """A finished request's times and prompt; a generation request's tokens and finish
        reasons (a pooling request has neither)."""
        self._last_tokens_at.pop(output.request_id, None)
        m = output.metrics
        arrived, scheduled, first, finished = (m.arrival_time, m.first_scheduled_time,
                                               m.first_token_time, m.finished_time)
        for histogram, start, end in ((self.ttft, arrived, first), (self.queue_time, arrived, scheduled),
                                      (self.prefill_time, scheduled, first), (self.e2e, arrived, finished),
                                      (self.inference_time, scheduled, finished),
                                      (self.decode_time, first, finished)):
            if start is not None and end is not None:
                histogram.observe(end - start)
        if first is not None and finished is not None and m.num_output_tokens > 1:
            self.tpot.observe((finished - first) / (m.num_output_tokens - 1))
        self.preemptions.observe(m.num_preemptions)
        self.prompt_tokens.observe(len(output.prompt_token_ids))
        if isinstance(output, PoolingRequestOutput):
            return
        self.generation_tokens.observe(sum(len(c.token_ids) for c in output.outputs))
        for completion in output.outputs:
            self.success.labels(completion.finish_reason or "abort").inc()

    def count_engine_requests(self, failed_fn: Callable[[], int], rejected_fn: Callable[[], int]) -> None:
        """pagedllm:engine_failed_requests_total: requests an engine step failed (a step's lone
        culprits, or every request of a step where none could be pinned);
        pagedllm:admission_rejections_total: requests refused because too many were waiting."""
        class _Counts:
            def collect(self):
                yield CounterMetricFamily("pagedllm:engine_failed_requests", "Requests ended by a failed "
                                          "engine step", value=failed_fn())
                rejected = CounterMetricFamily("pagedllm:admission_rejections", "Requests refused "
                                               "because too many were waiting", labels=["reason"])
                rejected.add_metric(["max_num_queued_reqs"], rejected_fn())
                yield rejected
        self.registry.register(_Counts())

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(self.vllm_names)


def _token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (token counts of a request or a step)."""
    buckets, scale = [], 1
    while scale <= max_model_len:
        buckets += [b for b in (scale, 2 * scale, 5 * scale) if b <= max_model_len]
        scale *= 10
    return buckets


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
