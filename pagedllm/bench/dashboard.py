"""`pagedllm bench dashboard`: what one dashboard snapshot costs the engine, against a decode step.

Fills the engine with --num-prompts requests (64 by default) in a cache of --num-blocks blocks,
steps until every one of them is decoding, then alternates one decode step and one snapshot,
--repeats times in one process, so both see the same machine. The snapshot is timed whole: what the
engine thread builds between two steps (figures and block map) and the JSON encoding the server
does. The server takes one snapshot per tick (4 a second) however many pages watch, so a step never
pays more than one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagedllm.bench.common import (
    add_threads_arg,
    apply_threads,
    engine_config,
    print_table,
    serve_one,
    write_json,
)
from pagedllm.bench.workload import load_workload, summarize
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.server.dashboard import core_snapshot

MAX_FILL_STEPS = 1000


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-blocks", type=int, default=4096,
                        help="KV blocks in the cache (a server has thousands; the block map covers all)")
    parser.add_argument("--repeats", type=int, default=30, help="decode steps and snapshots timed")
    add_threads_arg(parser)
    parser.set_defaults(func=main, num_prompts=64, input_len="128-384", output_len="400")


def main(args: argparse.Namespace) -> int:
    apply_threads(args)
    engine = LLMEngine(engine_config(args, num_kv_blocks=args.num_blocks))
    serve_one(engine)
    workload = load_workload(engine.tokenizer, args.dataset, args.num_prompts, args.input_len,
                             args.output_len, args.seed)
    for i, r in enumerate(workload):
        params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
        engine.add_request(f"bench-{i}", {"prompt_token_ids": r.prompt_token_ids}, params)
    _step_until_all_decode(engine, len(workload))
    step_s, snapshot_s, snapshot_bytes = [], [], 0
    for _ in range(args.repeats):
        started = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        snapshot_bytes = len(json.dumps(core_snapshot(engine), separators=(",", ":")))
        snapshot_s.append(time.perf_counter() - started)
        if engine.stats().num_running != len(workload):
            raise RuntimeError("a request finished or was preempted while measuring: raise "
                               "--output-len or --num-blocks")
    payload = _figures(engine, workload, step_s, snapshot_s, snapshot_bytes)
    _print(payload)
    write_json(args.output_json, payload)
    return 0


def _step_until_all_decode(engine: LLMEngine, num_requests: int) -> None:
    """Step through the prefills until one step computes exactly one token per request."""
    for _ in range(MAX_FILL_STEPS):
        before = engine.stats().num_computed_tokens
        engine.step()
        stats = engine.stats()
        if stats.num_computed_tokens - before == num_requests == stats.num_running:
            return
    raise RuntimeError(f"the {num_requests} requests never all ran at once: raise --num-blocks")


def _figures(engine: LLMEngine, workload, step_s: list[float], snapshot_s: list[float],
             snapshot_bytes: int) -> dict:
    def ms(values: list[float]) -> dict:
        deciles = statistics.quantiles(values, n=10)
        return {"median": round(1e3 * statistics.median(values), 3),
                "p10": round(1e3 * deciles[0], 3), "p90": round(1e3 * deciles[-1], 3)}

    shares = sorted(snap / step for snap, step in zip(snapshot_s, step_s))
    stats = engine.memory_stats()
    return {"workload": summarize(workload), "num_running": engine.stats().num_running,
            "num_blocks": stats["num_blocks"], "num_used_blocks": stats["num_used_blocks"],
            "snapshot_bytes": snapshot_bytes, "decode_step_ms": ms(step_s),
            "snapshot_ms": ms(snapshot_s),
            "snapshot_share_of_step_pct": round(100 * statistics.median(snapshot_s)
                                                / statistics.median(step_s), 3),
            "snapshot_share_pct_range": [round(100 * shares[0], 3), round(100 * shares[-1], 3)]}


def _print(p: dict) -> None:
    rows = [[name, p[key]["median"], p[key]["p10"], p[key]["p90"]]
            for name, key in (("decode step", "decode_step_ms"), ("snapshot", "snapshot_ms"))]
    print_table(f"Dashboard snapshot against a decode step: {p['num_running']} running requests, "
                f"{p['num_used_blocks']} of {p['num_blocks']} blocks in use",
                ["", "median ms", "p10 ms", "p90 ms"], rows)
    low, high = p["snapshot_share_pct_range"]
    print(f"\none snapshot ({p['snapshot_bytes']} bytes of JSON) = {p['snapshot_share_of_step_pct']}% "
          f"of a decode step (median; {low}-{high}% pair by pair)")
