"""Scheduler + KV manager overhead per decode step, at short and very long contexts.

Sets up `num_requests` running requests whose contexts are already `context_len` tokens
(prefilled in one untimed step), then times `steps` decode steps: schedule() and
update_from_output(), no model. The cost per step should depend on the number of running
requests, not on how long their contexts are.

The first decode step after the prefill is reported apart (warmup_step_ms): it does the
prefill's deferred work, O(prompt) once per request, not per step: with prefix caching it
registers every prompt block in the cache (blocks are cached once computed), and the
exactly-sized block lists grow for the first time, all 256 at once since every request
has the same length.

    python -m pagedllm.bench.scheduler_overhead --context-lens 1024,131072
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv.manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import cdiv


def setup_max_model_len(context_len: int, steps: int) -> int:
    """The max_model_len setup() gives its scheduler: room for the decode steps and a few more."""
    return context_len + steps + 5


def setup(num_requests: int, context_len: int, block_size: int, steps: int,
          prefix_caching: bool, sliding_window: int | None = None) -> Scheduler:
    """A scheduler whose num_requests requests have context_len tokens computed (the prompts
    prefilled in one step), each with room for `steps` more decodes."""
    max_model_len = setup_max_model_len(context_len, steps)
    num_blocks = num_requests * cdiv(max_model_len, block_size)
    manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching,
                             sliding_window=sliding_window)
    config = SchedulerConfig(max_num_seqs=num_requests,
                             max_num_batched_tokens=num_requests * context_len,
                             max_model_len=max_model_len)
    scheduler = Scheduler(config, manager)
    params = SamplingParams(max_tokens=steps + 3, ignore_eos=True)  # none finishes
    for i in range(num_requests):
        # Distinct prompts (nothing shared through the prefix cache), one token repeated.
        scheduler.add_request(Request(f"r{i}", [i + 1] * context_len, params))
    prefill = scheduler.schedule()  # the whole prompts, untimed
    assert len(prefill.scheduled) == num_requests
    scheduler.update_from_output(prefill, {s.request.request_id: 1 for s in prefill.scheduled})
    return scheduler


def _warmup_step_ms(scheduler: Scheduler) -> float:
    started = time.perf_counter()
    _time_steps(scheduler, 1)
    return (time.perf_counter() - started) * 1e3


def _time_steps(scheduler: Scheduler, steps: int) -> tuple[list[int], list[int]]:
    sampled = {r.request_id: 1 for r in scheduler.running}
    schedule_ns, update_ns = [], []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        out = scheduler.schedule()
        t1 = time.perf_counter_ns()
        scheduler.update_from_output(out, sampled)
        t2 = time.perf_counter_ns()
        assert len(out.scheduled) == len(sampled) and out.num_batched_tokens == len(sampled)
        schedule_ns.append(t1 - t0)
        update_ns.append(t2 - t1)
    return schedule_ns, update_ns


def _summary(ns: list[int]) -> dict:
    ordered = sorted(ns)
    return {"mean_us": statistics.fmean(ns) / 1e3, "p50_us": ordered[len(ns) // 2] / 1e3,
            "p99_us": ordered[min(len(ns) - 1, int(len(ns) * 0.99))] / 1e3,
            "max_us": ordered[-1] / 1e3}


def measure(num_requests: int, context_len: int, block_size: int, steps: int,
            prefix_caching: bool = False) -> dict:
    started = time.perf_counter()
    scheduler = setup(num_requests, context_len, block_size, steps, prefix_caching)
    setup_s = time.perf_counter() - started
    warmup_step_ms = _warmup_step_ms(scheduler)
    schedule_ns, update_ns = _time_steps(scheduler, steps)
    total_ns = [a + b for a, b in zip(schedule_ns, update_ns)]
    total = _summary(total_ns)
    stats = scheduler.kv_manager.stats()
    return {
        "context_len": context_len, "num_requests": num_requests, "block_size": block_size,
        "steps": steps, "prefix_caching": prefix_caching, "num_blocks": stats.num_blocks,
        "setup_s": setup_s, "warmup_step_ms": warmup_step_ms,
        "schedule": _summary(schedule_ns), "update": _summary(update_ns),
        "total": total, "per_request_ns": total["p50_us"] * 1e3 / num_requests,
        "kv_usage": stats.usage, "num_preemptions": scheduler.num_preemptions,
    }


def run(num_requests: int = 256, context_lens: tuple[int, ...] = (1024, 131072),
        block_size: int = 16, steps: int = 256, prefix_caching: bool = False) -> dict:
    results = []
    for context_len in context_lens:
        results.append(measure(num_requests, context_len, block_size, steps, prefix_caching))
        gc.collect()  # drop the previous setup's millions of blocks before the next
    # Medians: on a shared machine the mean picks up other processes' time slices.
    base = results[0]["total"]["p50_us"]
    for result in results:
        result["p50_vs_first"] = result["total"]["p50_us"] / base if base else 0.0
    return {"benchmark": "scheduler_overhead", "python": sys.version.split()[0],
            "results": results}


def format_table(report: dict) -> str:
    header = (f"{'context':>8} {'reqs':>5} {'steps':>5} {'schedule us':>12} {'update us':>10} "
              f"{'total us':>9} {'p50 us':>8} {'p99 us':>8} {'ns/req':>7} {'p50 x first':>11}")
    lines = [header, "-" * len(header)]
    for r in report["results"]:
        lines.append(
            f"{r['context_len']:>8} {r['num_requests']:>5} {r['steps']:>5} "
            f"{r['schedule']['mean_us']:>12.1f} {r['update']['mean_us']:>10.1f} "
            f"{r['total']['mean_us']:>9.1f} {r['total']['p50_us']:>8.1f} "
            f"{r['total']['p99_us']:>8.1f} {r['per_request_ns']:>7.0f} "
            f"{r['p50_vs_first']:>11.2f}")
    return "\n".join(lines)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers; got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers; got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pagedllm bench scheduler",
        description="Scheduler + KV manager overhead per decode step (no model).")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--context-lens", type=_int_list, default=(1024, 131072),
                        help="comma-separated context lengths (default 1024,131072)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=256, help="timed decode steps")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="hash and cache full blocks as they fill")
    parser.add_argument("--output-json", default=None, help="also write the report here")
    args = parser.parse_args(argv)
    if args.num_requests < 1 or args.steps < 1 or args.block_size < 1:
        parser.error("--num-requests, --steps and --block-size must be positive")
    report = run(args.num_requests, args.context_lens, args.block_size, args.steps,
                 args.prefix_caching)
    print(format_table(report))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
