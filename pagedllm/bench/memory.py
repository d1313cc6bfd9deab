"""`pagedllm bench memory`: one workload, one KV budget, paged against contiguous reservation.

Per step it records allocated and used KV slots and the running / waiting requests; it reports
waste (empty slots in allocated memory / allocated), the most requests running at once,
throughput and preemptions for each layout, and draws both over time, one above the other.
With --html it also writes the server's KV cache page as a report: both block maps played back
side by side (bench/memory_report.py). With --families it compares model families instead: bytes
per KV token and requests at once in a fixed budget (bench/memory_families.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

from pagedllm.bench import memory_families
from pagedllm.bench.common import (
    RunResult,
    StepRecord,
    add_threads_arg,
    apply_threads,
    engine_config,
    print_table,
    run_workload,
    serve_one,
    shared_model_loads,
    write_json,
)
from pagedllm.bench.memory_report import FrameRecorder, write_report
from pagedllm.bench.workload import BenchRequest, load_workload, summarize
from pagedllm.config import SchedulerConfig
from pagedllm.core.kv.contiguous import ContiguousKVManager
from pagedllm.core.kv.manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.model.tokenizer_files import load_tokenizer
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import cdiv

SEED_CLAIMS = {"paged_waste_pct": "under 4%", "contiguous_waste_pct": "60-80% (vLLM paper)",
               "concurrency": "2-4x more requests at once"}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reservations", type=int, default=16,
                        help="KV budget as this many contiguous reservations of max_model_len tokens")
    parser.add_argument("--simulate", action="store_true",
                        help="scheduler and KV manager only, no model: the same memory figures in "
                             "seconds (tokens do not matter with ignore_eos), no timings")
    parser.add_argument("--plot", default="bench-out/memory.png", help="PNG path ('' for none)")
    parser.add_argument("--html", default=None, metavar="PATH",
                        help="also write the KV cache page as a static report: both layouts' block "
                             "maps side by side, played back over the run (recording them adds "
                             "a fraction of a millisecond to each step)")
    memory_families.add_args(parser)
    add_threads_arg(parser)
    # Block 16 (not the engine's CPU default): the layouts' waste compared at a fine grain.
    parser.set_defaults(func=main, num_prompts=64, input_len="32-512", output_len="32-256",
                        max_model_len=1024, block_size=16)


def layout_figures(result: RunResult, timed: bool = True) -> dict:
    """Waste, concurrency and preemptions over the run's steps (and its rates when timed)."""
    steps = result.steps
    allocated = sum(s.allocated_slots for s in steps)
    used = sum(s.used_slots for s in steps)
    peak = max(steps, key=lambda s: s.allocated_slots)
    return {
        # averaged over steps (each step's state once), weighted by allocation: empty / allocated
        "waste_pct": round(100.0 * (allocated - used) / allocated, 2) if allocated else 0.0,
        **({"waste_pct_time_weighted": _time_weighted_waste_pct(steps)} if timed else {}),
        "peak_waste_pct": round(100.0 * (peak.allocated_slots - peak.used_slots)
                                / peak.allocated_slots, 2) if peak.allocated_slots else 0.0,
        "peak_allocated_slots": peak.allocated_slots,
        "max_running": max(s.running for s in steps),
        "mean_running": round(sum(s.running for s in steps) / len(steps), 2),
        "num_steps": len(steps),
        "num_preemptions": result.num_preemptions,
        **(result.rates() if timed else {}),
        "timeline": [[round(s.t_s, 4), s.allocated_slots, s.used_slots, s.running, s.waiting]
                     for s in steps],
    }


def _time_weighted_waste_pct(steps: list[StepRecord]) -> float:
    """Waste with each step's state weighted by how long it lasted (until the next record)."""
    allocated = used = 0.0
    for before, step in zip(steps, steps[1:]):
        duration = step.t_s - before.t_s
        allocated += duration * before.allocated_slots
        used += duration * before.used_slots
    return round(100.0 * (allocated - used) / allocated, 2) if allocated else 0.0


def simulate_workload(scheduler: Scheduler, requests: list[BenchRequest],
                      on_step: Callable[[float], None] | None = None) -> RunResult:
    """Drive the scheduler and its KV manager as the engine would, without a model: every
    request is added at once (greedy, ignore_eos) and each step "samples" token 0. With
    ignore_eos only lengths decide when a request stops, so the steps and the memory figures are
    the ones a real run gets. Step records carry the step index as their time; so do the calls
    of on_step, made after each step."""
    for i, r in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
        scheduler.add_request(Request(f"sim-{i}", list(r.prompt_token_ids), params, arrival_time=i))
    steps: list[StepRecord] = []
    output_tokens = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        sampled = {s.request.request_id: 0 for s in out.scheduled if s.samples}
        output_tokens += len(sampled)
        scheduler.update_from_output(out, sampled)
        kv = scheduler.kv_manager.stats()
        steps.append(StepRecord(len(steps), kv.allocated_slots, kv.used_slots,
                                scheduler.num_running, scheduler.num_waiting))
        if on_step is not None:
            on_step(steps[-1].t_s)
    return RunResult(0.0, len(requests), sum(len(r.prompt_token_ids) for r in requests),
                     output_tokens, scheduler.num_preemptions, steps)


def simulated_scheduler(args: argparse.Namespace, layout: str, max_model_len: int,
                        num_blocks: int) -> Scheduler:
    """The scheduler and KV manager an engine with these settings makes (prefix caching off)."""
    config = SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, max_model_len)
    if layout == "contiguous":
        manager = ContiguousKVManager(num_blocks, args.block_size, max_model_len)
    else:
        manager = KVCacheManager(num_blocks, args.block_size, enable_prefix_caching=False)
    return Scheduler(config, manager)


def scheduler_figures(scheduler: Scheduler) -> dict:
    """A simulated run's figures, under the names an engine's memory_stats() uses."""
    kv = scheduler.kv_manager.stats()
    return {**kv.to_dict(), "kv_cache_bytes": kv.num_blocks * kv.bytes_per_block,
            "num_running": scheduler.num_running, "num_waiting": scheduler.num_waiting,
            "num_preemptions": scheduler.num_preemptions}


def main(args: argparse.Namespace) -> int:
    if args.families:
        return memory_families.main(args)
    apply_threads(args)
    max_model_len = args.max_model_len or 1024
    num_blocks = args.reservations * cdiv(max_model_len, args.block_size)
    results, frames = {}, {}
    workload = None
    if args.simulate:
        workload = load_workload(load_tokenizer(args.model), args.dataset, args.num_prompts,
                                 args.input_len, args.output_len, args.seed)
    with shared_model_loads():  # both engines use the same weights, loaded once
        for layout in ("paged", "contiguous"):
            if args.simulate:
                scheduler = simulated_scheduler(args, layout, max_model_len, num_blocks)
                recorder = FrameRecorder(partial(scheduler_figures, scheduler),
                                         scheduler.kv_manager.block_map) if args.html else None
                run = simulate_workload(scheduler, workload, recorder.record if recorder else None)
                results[layout] = layout_figures(run, timed=False)
                results[layout]["token_slots"] = num_blocks * args.block_size
            else:
                engine = LLMEngine(engine_config(args, kv_layout=layout, max_model_len=max_model_len,
                                                 num_kv_blocks=num_blocks, enable_prefix_caching=False))
                if workload is None:
                    workload = load_workload(engine.tokenizer, args.dataset, args.num_prompts,
                                             args.input_len, args.output_len, args.seed)
                serve_one(engine)  # first-call costs (kernel load, weight packing) stay off the clock
                recorder = FrameRecorder(engine.memory_stats, engine.block_map) if args.html else None
                run = run_workload(engine, workload, record_steps=True,
                                   on_step=recorder.record if recorder else None)
                results[layout] = layout_figures(run)
                results[layout]["kv_cache_bytes"] = engine.kv_plan.kv_cache_bytes
                results[layout]["token_slots"] = engine.kv_plan.num_slots
                del engine
            if recorder is not None:
                frames[layout] = recorder.finish()
    paged, contiguous = results["paged"], results["contiguous"]
    payload = {"workload": summarize(workload), "max_model_len": max_model_len,
               "reservations": args.reservations, "block_size": args.block_size,
               "simulated": args.simulate, "seed_claims": SEED_CLAIMS,
               "concurrency_ratio": round(paged["max_running"] / max(contiguous["max_running"], 1), 2),
               **results}
    _print(payload)
    if args.plot:
        _plot(payload, args.plot)
    if args.html:
        write_report(args.html, payload, frames)
    write_json(args.output_json, payload)
    return 0


def _print(p: dict) -> None:
    rows = []
    for layout in ("paged", "contiguous"):
        r = p[layout]
        rows.append([layout, f"{r['waste_pct']}%", f"{r['peak_waste_pct']}%", r["max_running"],
                     r["mean_running"], r["num_preemptions"], r.get("output_tokens_per_s", "-"),
                     r.get("elapsed_s", "-")])
    print_table(f"KV memory: {p['workload']['num_requests']} requests, budget = {p['reservations']} x "
                f"{p['max_model_len']} tokens", ["layout", "waste (avg)", "waste (peak)", "max running",
                                                  "mean running", "preemptions", "out tok/s", "time s"],
                rows)
    print(f"\npaged runs {p['concurrency_ratio']}x as many requests at once.")
    print("Seed claims: paged waste " + SEED_CLAIMS["paged_waste_pct"] + ", contiguous waste "
          + SEED_CLAIMS["contiguous_waste_pct"] + ", " + SEED_CLAIMS["concurrency"] + ".")


def _plot(p: dict, path: str) -> None:
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 7), sharex=False)
    for ax, layout in zip(axes, ("paged", "contiguous")):
        timeline = p[layout]["timeline"]
        t = [row[0] for row in timeline]
        ax.fill_between(t, [row[1] for row in timeline], step="post", alpha=0.3, label="allocated slots")
        ax.plot(t, [row[2] for row in timeline], drawstyle="steps-post", label="used slots")
        ax.set_ylabel("KV token slots")
        ax.set_title(f"{layout}: waste {p[layout]['waste_pct']}%, up to {p[layout]['max_running']} running")
        twin = ax.twinx()
        twin.plot(t, [row[3] for row in timeline], color="tab:red", drawstyle="steps-post",
                  label="running requests")
        twin.set_ylabel("running requests")
        ax.legend(loc="upper left")
        twin.legend(loc="upper right")
    axes[-1].set_xlabel("steps (simulated, no model)" if p.get("simulated") else "seconds")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")
