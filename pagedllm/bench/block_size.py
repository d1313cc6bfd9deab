"""`pagedllm bench block-size`: one workload, one KV budget in tokens, several block sizes.

For each block size it reports what the page size trades: KV waste (empty slots in allocated
blocks, time-averaged as in `bench memory`; it grows with the block, since a request's last block
is half empty on average), concurrency and preemptions under the fixed budget, throughput, and the
share of the run's wall time spent inside the attention calls.

Attention time share: every call of `pagedllm.kernels.attention.paged_attention` (and, separately,
`write_kv`) is wrapped with a wall-clock timer for the run, wherever the model imported it from
(bench.common.timed_functions); share = seconds inside those calls / the run's elapsed seconds.
On the CPU a call returns when its work is done, so no synchronisation is needed. The
implementations behind it (compiled CPU kernel, torch reference) are timed too, to report which ran.
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedllm.bench.attention import known_implementations, parse_int_list
from pagedllm.bench.common import (
    RunResult,
    add_threads_arg,
    apply_threads,
    engine_config,
    print_table,
    run_workload,
    serve_one,
    shared_model_loads,
    timed_functions,
    write_json,
)
from pagedllm.bench.memory import layout_figures
from pagedllm.bench.workload import load_workload, summarize
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.kernels.attention import paged_attention, write_kv

DEFAULT_BLOCK_SIZES = "8,16,32,64,128"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-sizes", default=DEFAULT_BLOCK_SIZES,
                        help="block sizes (tokens) to sweep; --block-size is ignored")
    parser.add_argument("--kv-tokens", default="16k",
                        help="KV budget in token slots, the same for every block size")
    parser.add_argument("--plot", default="bench-out/block_size.png", help="PNG path ('' for none)")
    add_threads_arg(parser)
    parser.set_defaults(func=main, num_prompts=64, input_len="32-512", output_len="32-256",
                        max_model_len=1024, enable_prefix_caching=False)


def num_blocks_for(kv_tokens: int, block_size: int) -> int:
    """Whole blocks that fit in the token budget."""
    return kv_tokens // block_size


def sweep_row(block_size: int, result: RunResult, attention_s: float, write_kv_s: float,
              attention_calls: int, cpu_s: float) -> dict:
    """One block size's figures; shares are of the run's elapsed wall time. Tokens per CPU
    second (this process's CPU time) hold still when a shared machine takes the core away
    part of the time, which wall-clock rates do not (most telling with --threads 1)."""
    figures = layout_figures(result)
    elapsed = max(result.elapsed_s, 1e-9)
    return {
        "block_size": block_size,
        "waste_pct": figures["waste_pct"],
        "peak_waste_pct": figures["peak_waste_pct"],
        "max_running": figures["max_running"],
        "mean_running": figures["mean_running"],
        "num_preemptions": figures["num_preemptions"],
        "num_steps": figures["num_steps"],
        "elapsed_s": figures["elapsed_s"],
        "output_tokens_per_s": figures["output_tokens_per_s"],
        "total_tokens_per_s": figures["total_tokens_per_s"],
        "cpu_s": round(cpu_s, 3),
        "output_tokens_per_cpu_s": round(result.output_tokens / max(cpu_s, 1e-9), 2),
        "attention_s": round(attention_s, 3),
        "attention_calls": attention_calls,
        "attention_share_pct": round(100.0 * attention_s / elapsed, 1),
        "write_kv_share_pct": round(100.0 * write_kv_s / elapsed, 1),
    }


def main(args: argparse.Namespace) -> int:
    apply_threads(args)
    block_sizes = parse_int_list(args.block_sizes)
    kv_tokens = parse_int_list(args.kv_tokens)[0]
    max_model_len = args.max_model_len or 1024
    rows, workload = [], None
    with shared_model_loads():
        for block_size in block_sizes:
            engine = LLMEngine(engine_config(args, block_size=block_size, max_model_len=max_model_len,
                                             num_kv_blocks=num_blocks_for(kv_tokens, block_size)))
            if workload is None:
                workload = load_workload(engine.tokenizer, args.dataset, args.num_prompts,
                                         args.input_len, args.output_len, args.seed)
            serve_one(engine)  # warm-up: first calls (kernel build, allocator) are not timed
            impls = known_implementations()
            cpu_started = time.process_time()
            with timed_functions(paged_attention, write_kv, *impls.values()) as timers:
                result = run_workload(engine, workload, record_steps=True, tag=f"bs{block_size}")
            cpu_s = time.process_time() - cpu_started
            attn_timer, write_timer, *impl_timers = timers
            row = sweep_row(block_size, result, attn_timer.seconds, write_timer.seconds,
                            attn_timer.calls, cpu_s)
            # which implementation(s) the public paged_attention ran, and how often
            row["implementation_calls"] = {name: t.calls for name, t in zip(impls, impl_timers)
                                           if t.calls}
            rows.append(row)
            print(f"block {block_size}: waste {row['waste_pct']}%, {row['output_tokens_per_s']} "
                  f"out tok/s, attention {row['attention_share_pct']}% of the time", flush=True)
            del engine
    payload = {"workload": summarize(workload), "kv_tokens": kv_tokens, "max_model_len": max_model_len,
               "dtype": args.dtype, "prefix_caching": args.enable_prefix_caching,
               "num_threads": torch.get_num_threads(),
               "attention_timing": "wall time inside paged_attention calls / run elapsed time",
               "sweep": rows}
    _print(payload)
    if args.plot:
        _plot(payload, args.plot)
    write_json(args.output_json, payload)
    return 0


def _print(p: dict) -> None:
    header = ["block", "waste (avg)", "waste (peak)", "max running", "mean running", "preemptions",
              "out tok/s", "out tok/CPU s", "attention share", "write_kv share", "time s",
              "attention impl"]
    rows = [[r["block_size"], f"{r['waste_pct']}%", f"{r['peak_waste_pct']}%", r["max_running"],
             r["mean_running"], r["num_preemptions"], r["output_tokens_per_s"],
             r["output_tokens_per_cpu_s"],
             f"{r['attention_share_pct']}%", f"{r['write_kv_share_pct']}%", r["elapsed_s"],
             ",".join(r["implementation_calls"]) or "-"]
            for r in p["sweep"]]
    print_table(f"Block size sweep: {p['workload']['num_requests']} requests, KV budget "
                f"{p['kv_tokens']} token slots, max_model_len {p['max_model_len']}", header, rows)


def _plot(p: dict, path: str) -> None:
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["block_size"] for r in p["sweep"]]
    panels = [("waste_pct", "KV waste, averaged over steps (%)"),
              ("output_tokens_per_cpu_s", "generated tokens / CPU second"),
              ("attention_share_pct", "attention share of wall time (%)"),
              ("mean_running", "mean running requests")]
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 3.8))
    for ax, (key, label) in zip(axes, panels):
        ax.plot(sizes, [r[key] for r in p["sweep"]], marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("block size (tokens)")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Block size sweep: {p['workload']['num_requests']} requests, "
                 f"{p['kv_tokens']} KV token slots")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")
