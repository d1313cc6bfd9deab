"""`pagedllm bench long-context`: what paging costs from 1k to 1M tokens of context.

Three measurements, for each context length and block size:

- Per-step upkeep (no model): `batch` requests whose contexts are already `context` tokens long
  decode `steps` tokens through the real scheduler, KV manager and runner metadata
  (`ModelRunner.prepare_inputs` with a stub model: every integer the kernels get is built, nothing
  is computed). Reported: the median step and its parts, the ratio to the shortest context (flat
  means paging's bookkeeping does not grow with context), and what the runner did before its block
  table was kept in place: gathering every scheduled request's row, whose width follows the
  context, into a fresh table each step (timed here on the same table).
- Block-table bytes per request: the KV manager's two lists (block objects and ids: 8-byte
  pointers per block), the prefix-cache hashes of a request's blocks, the runner's row (4 bytes per
  block; a GPU keeps one more copy), next to the request's own token ids (8-byte pointers per
  token) and to the dense [max_num_seqs, max_model_len / block_size] table the runner used to
  reserve at start-up.
- Attention: one decode over a synthetic paged cache of the whole context (blocks in shuffled
  order; SmolLM2-135M's heads by default) through `pagedllm.kernels.attention.paged_attention`, whichever
  backend it picks, for contexts whose cache fits --max-kv-memory; and, with --window, over a
  sliding window of that many tokens (the blocks before it may be freed: attention reads the
  window only).

    pagedllm bench long-context --contexts 1k,8k,128k,1m --block-sizes 16,32,64,128,256
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import numpy as np
import torch

from pagedllm.bench import scheduler_overhead
from pagedllm.bench.attention import parse_int_list, stub_runner, time_call
from pagedllm.bench.common import add_threads_arg, apply_threads, print_table, write_json
from pagedllm.config import parse_size
from pagedllm.core.kv.manager import NULL_BLOCK
from pagedllm.core.scheduler import Scheduler
from pagedllm.kernels import attention
from pagedllm.kernels.attention.metadata import AttentionMetadata
from pagedllm.utils import cdiv
from pagedllm.worker.runner import ModelRunner

# SmolLM2-135M's attention: 9 query heads, 3 KV heads, head_dim 64, 30 layers.
SHAPE = {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "num_layers": 30}
DENSE_TABLE_ROWS = 256  # EngineConfig's default max_num_seqs: the rows the old table reserved


# -- per-step upkeep --------------------------------------------------------------------------------

def timed_step(scheduler: Scheduler, runner: ModelRunner, sampled: dict[str, int]) -> tuple[int, ...]:
    """One decode step: schedule, the runner's metadata, update. Nanoseconds of each."""
    t0 = time.perf_counter_ns()
    out = scheduler.schedule()
    t1 = time.perf_counter_ns()
    runner.prepare_inputs(out.scheduled)
    t2 = time.perf_counter_ns()
    scheduler.update_from_output(out, sampled)
    t3 = time.perf_counter_ns()
    assert len(out.scheduled) == len(sampled) == out.num_batched_tokens, "not a decode step"
    return t1 - t0, t2 - t1, t3 - t2


def old_table_copy_ns(runner: ModelRunner, batch: int, context_len: int, block_size: int,
                      repeats: int) -> int:
    """Median time of what the runner used to do every step: gather the scheduled rows, up to the
    longest context's blocks, into a fresh [batch, blocks] table."""
    table, rows, width = runner.block_table.table, np.arange(batch), cdiv(context_len, block_size)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        table[rows, :width]  # noqa: B018 (the copy is what is timed)
        times.append(time.perf_counter_ns() - t0)
    return int(statistics.median(times))


def table_bytes(scheduler: Scheduler, runner: ModelRunner) -> dict:
    """Bytes of block-table state per request, measured on the live objects (the first request).
    The KV manager keeps two lists of the table's length: the block objects and their ids."""
    request = scheduler.running[0]
    ids = scheduler.kv_manager.block_ids(request)
    hashes = request.block_hashes
    return {
        "manager": 2 * sys.getsizeof(ids),
        "prefix_hashes": sys.getsizeof(hashes) + sum(sys.getsizeof(h) for h in hashes),
        "runner_row": runner.block_table.table[0].nbytes,
        "token_ids": sys.getsizeof(request.token_ids),
        "held_blocks": len(ids) - ids.count(NULL_BLOCK),
    }


def measure_upkeep(batch: int, context_len: int, block_size: int, steps: int,
                   sliding_window: int | None, prefix_caching: bool) -> dict:
    started = time.perf_counter()
    scheduler = scheduler_overhead.setup(batch, context_len, block_size, steps, prefix_caching,
                                         sliding_window)
    max_model_len = scheduler_overhead.setup_max_model_len(context_len, steps)
    runner = stub_runner(block_size, batch, max_model_len)
    setup_s = time.perf_counter() - started
    sampled = {r.request_id: 1 for r in scheduler.running}
    # The first step after the prefill does its deferred work once: the rows are filled, the
    # prompt's blocks hashed into the prefix cache, a window's old blocks given back.
    warmup_ms = sum(timed_step(scheduler, runner, sampled)) / 1e6
    parts = [timed_step(scheduler, runner, sampled) for _ in range(steps)]
    totals = [sum(p) for p in parts]
    p50 = statistics.median(totals)
    return {
        "batch": batch, "context_len": context_len, "block_size": block_size,
        "sliding_window": sliding_window, "prefix_caching": prefix_caching, "steps": steps,
        "setup_s": round(setup_s, 2), "warmup_step_ms": round(warmup_ms, 3),
        "step_us": round(p50 / 1e3, 2),
        "step_p99_us": round(sorted(totals)[min(len(totals) - 1, int(0.99 * len(totals)))] / 1e3, 2),
        "schedule_us": round(statistics.median(p[0] for p in parts) / 1e3, 2),
        "prepare_us": round(statistics.median(p[1] for p in parts) / 1e3, 2),
        "update_us": round(statistics.median(p[2] for p in parts) / 1e3, 2),
        "old_table_copy_us": round(old_table_copy_ns(runner, batch, context_len, block_size,
                                                     steps) / 1e3, 2),
        "bytes": table_bytes(scheduler, runner),
        "dense_table_bytes": DENSE_TABLE_ROWS * cdiv(max_model_len, block_size) * 4,
        "num_preemptions": scheduler.num_preemptions,
    }


# -- attention --------------------------------------------------------------------------------------

def synthetic_cache(num_slots: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of num_slots tokens, [num_slots, Hkv, D] each, viewed per block size later."""
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.empty(num_slots, num_kv_heads, head_dim, dtype=dtype).uniform_(
        -1, 1, generator=generator) for _ in range(2))


def decode_metadata(context_len: int, block_size: int, seed: int) -> AttentionMetadata:
    """One request decoding its last token over context_len tokens in shuffled blocks."""
    num_blocks = cdiv(context_len, block_size)
    generator = torch.Generator().manual_seed(seed)
    table = torch.randperm(num_blocks, generator=generator).to(torch.int32)[None, :]
    last = context_len - 1
    slot = int(table[0, last // block_size]) * block_size + last % block_size
    return AttentionMetadata(
        slot_mapping=torch.tensor([slot]), block_tables=table,
        seq_lens=torch.tensor([context_len], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens_cpu=[context_len], query_start_loc_cpu=[0, 1])


def measure_attention(keys: torch.Tensor, values: torch.Tensor, context_len: int, block_size: int,
                      window: int | None, num_heads: int, min_time_s: float, max_reps: int) -> float:
    """Milliseconds of one decode's attention in one layer (median)."""
    num_blocks = cdiv(context_len, block_size)
    shape = (num_blocks, block_size, *keys.shape[1:])
    key_cache = keys[:num_blocks * block_size].view(shape)
    value_cache = values[:num_blocks * block_size].view(shape)
    generator = torch.Generator().manual_seed(block_size)
    query = torch.randn(1, num_heads, keys.shape[-1], generator=generator).to(keys.dtype)
    meta = decode_metadata(context_len, block_size, seed=block_size)
    scale = keys.shape[-1] ** -0.5
    seconds, _ = time_call(lambda: attention.paged_attention(query, key_cache, value_cache, meta,
                                                             scale, window),
                           min_time_s, max_reps)
    return round(seconds * 1e3, 4)


def attention_rows(contexts: list[int], block_sizes: list[int], window: int | None,
                   dtype: torch.dtype, max_kv_bytes: int, min_time_s: float, max_reps: int) -> list:
    rows = []
    bytes_per_token = 2 * SHAPE["num_kv_heads"] * SHAPE["head_dim"] * dtype.itemsize
    for context_len in contexts:
        if context_len * bytes_per_token > max_kv_bytes:
            print(f"attention at {context_len} tokens skipped: its K/V take "
                  f"{context_len * bytes_per_token / 2**20:.0f} MiB > --max-kv-memory", flush=True)
            continue
        slots = max(cdiv(context_len, bs) * bs for bs in block_sizes)
        keys, values = synthetic_cache(slots, SHAPE["num_kv_heads"], SHAPE["head_dim"], dtype)
        for block_size in block_sizes:
            row = {"context_len": context_len, "block_size": block_size,
                   "full_ms": measure_attention(keys, values, context_len, block_size, None,
                                                SHAPE["num_heads"], min_time_s, max_reps)}
            if window is not None:
                row["window_ms"] = measure_attention(keys, values, context_len, block_size, window,
                                                     SHAPE["num_heads"], min_time_s, max_reps)
            rows.append(row)
            print(f"attention L={context_len} block {block_size}: {row['full_ms']} ms full"
                  + (f", {row['window_ms']} ms over a {window}-token window" if window else ""),
                  flush=True)
        del keys, values
        gc.collect()
    return rows


# -- the command -------------------------------------------------------------------------------------

def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--contexts", default="1k,8k,128k,1m",
                        help="context lengths in tokens (1k = 1024, 1m = 1024k)")
    parser.add_argument("--block-sizes", default="16,32,64,128,256")
    parser.add_argument("--batch", type=int, default=8, help="decoding requests in the upkeep runs")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per upkeep run")
    parser.add_argument("--window", type=int, default=4096,
                        help="also run with a sliding window of this many tokens (0: not)")
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                        help="upkeep without hashing blocks into the prefix cache")
    parser.add_argument("--max-kv-memory", default="2GiB",
                        help="skip attention at contexts whose synthetic K/V is larger")
    parser.add_argument("--min-time", type=float, default=0.3,
                        help="seconds to spend timing each attention call (median)")
    parser.add_argument("--max-reps", type=int, default=20)
    parser.add_argument("--plot", default="bench-out/long_context.png", help="PNG path ('' for none)")
    add_threads_arg(parser)
    parser.set_defaults(func=main, output_json="bench-out/long_context.json")


def main(args: argparse.Namespace) -> int:
    from pagedllm.model.loader import resolve_dtype

    apply_threads(args)
    dtype = resolve_dtype(args.dtype)
    contexts, block_sizes = parse_int_list(args.contexts), parse_int_list(args.block_sizes)
    window = args.window or None
    if args.batch < 1 or args.steps < 1:
        raise ValueError("--batch and --steps must be positive")
    upkeep = []
    for window_case in (None, window) if window else (None,):
        for block_size in block_sizes:
            for context_len in contexts:
                row = measure_upkeep(args.batch, context_len, block_size, args.steps, window_case,
                                     args.prefix_caching)
                upkeep.append(row)
                print(f"upkeep L={context_len} block {block_size} window {window_case}: "
                      f"{row['step_us']} us/step (old table copy {row['old_table_copy_us']} us)",
                      flush=True)
                gc.collect()  # the previous setup's blocks, before the next
    _add_ratios(upkeep)
    attention_cases = attention_rows(contexts, block_sizes, window, dtype,
                                     parse_size(args.max_kv_memory), args.min_time, args.max_reps)
    payload = {"benchmark": "long_context", "batch": args.batch, "steps": args.steps,
               "prefix_caching": args.prefix_caching, "window": window,
               "dtype": str(dtype).removeprefix("torch."), "num_threads": torch.get_num_threads(),
               **SHAPE, "upkeep": upkeep, "attention": attention_cases}
    print_report(payload)
    write_json(args.output_json, payload)
    if args.plot:
        plot(payload, args.plot)
    return 0


def _add_ratios(rows: list[dict]) -> None:
    """Each upkeep step time over that of the shortest context with the same block size and
    window: the growth with context."""
    base = {}
    for r in sorted(rows, key=lambda r: r["context_len"]):
        key = (r["block_size"], r["sliding_window"])
        base.setdefault(key, r["step_us"])
        r["vs_shortest"] = round(r["step_us"] / base[key], 2) if base[key] else 0.0


def _kib(n: int) -> str:
    return f"{n / 1024:.1f}"


def print_report(p: dict) -> None:
    header = ["window", "block", "context", "step us", "p99 us", "x shortest", "schedule",
              "prepare", "update", "old copy us", "warmup ms"]
    rows = [[r["sliding_window"] or "-", r["block_size"], r["context_len"], r["step_us"],
             r["step_p99_us"], r["vs_shortest"], r["schedule_us"], r["prepare_us"], r["update_us"],
             r["old_table_copy_us"], r["warmup_step_ms"]] for r in p["upkeep"]]
    print_table(f"Per-step upkeep: scheduler + KV manager + runner metadata, {p['batch']} decoding "
                f"requests, median of {p['steps']} steps (prefix caching "
                f"{'on' if p['prefix_caching'] else 'off'})", header, rows)
    header = ["window", "block", "context", "manager KiB", "hashes KiB", "runner row KiB",
              "held blocks", "token ids KiB", f"dense {DENSE_TABLE_ROWS}-row table MiB"]
    rows = [[r["sliding_window"] or "-", r["block_size"], r["context_len"],
             _kib(r["bytes"]["manager"]), _kib(r["bytes"]["prefix_hashes"]),
             _kib(r["bytes"]["runner_row"]), r["bytes"]["held_blocks"], _kib(r["bytes"]["token_ids"]),
             f"{r['dense_table_bytes'] / 2**20:.1f}"] for r in p["upkeep"]]
    print_table("Block-table state per request (a GPU keeps one more runner row)", header, rows)
    if p["attention"]:
        header = ["block", "context", "attention ms/layer"]
        if p["window"]:
            header.append(f"{p['window']}-token window ms")
        header.append(f"upkeep / ({p['num_layers']} layers of attention)")
        upkeep = {(r["block_size"], r["context_len"]): r for r in p["upkeep"]
                  if r["sliding_window"] is None}
        rows = []
        for a in p["attention"]:
            row = [a["block_size"], a["context_len"], a["full_ms"]]
            if p["window"]:
                row.append(a["window_ms"])
            u = upkeep.get((a["block_size"], a["context_len"]))
            share = (f"{100 * u['step_us'] / p['batch'] / 1e3 / (p['num_layers'] * a['full_ms']):.3f}%"
                     if u else "-")
            rows.append(row + [share])
        print_table(f"Attention: one decode over a paged synthetic cache ({p['dtype']}, "
                    f"{p['num_heads']} heads / {p['num_kv_heads']} KV heads x {p['head_dim']}, "
                    f"{p['num_threads']} threads); upkeep share per request", header, rows)


def plot(p: dict, path: str) -> None:
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    ax = axes[0]
    for window in dict.fromkeys(r["sliding_window"] for r in p["upkeep"]):
        for block_size in dict.fromkeys(r["block_size"] for r in p["upkeep"]):
            rows = [r for r in p["upkeep"]
                    if r["block_size"] == block_size and r["sliding_window"] == window]
            label = f"block {block_size}" + (f", window {window}" if window else "")
            ax.plot([r["context_len"] for r in rows], [r["step_us"] for r in rows], marker="o",
                    linestyle="--" if window else "-", label=label)
    rows = [r for r in p["upkeep"] if r["block_size"] == p["upkeep"][0]["block_size"]
            and r["sliding_window"] is None]
    ax.plot([r["context_len"] for r in rows], [r["old_table_copy_us"] for r in rows], color="black",
            marker="x", linestyle=":", label=f"old per-step table copy alone (block {rows[0]['block_size']})")
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="us per step",
           title=f"Per-step upkeep, {p['batch']} requests")
    ax.legend(fontsize=7)

    ax = axes[1]
    for block_size in dict.fromkeys(r["block_size"] for r in p["upkeep"]):
        rows = [r for r in p["upkeep"] if r["block_size"] == block_size and r["sliding_window"] is None]
        ax.plot([r["context_len"] for r in rows],
                [(r["bytes"]["manager"] + r["bytes"]["runner_row"]) / 1024 for r in rows],
                marker="o", label=f"block {block_size}")
    rows = [r for r in p["upkeep"] if r["block_size"] == p["upkeep"][0]["block_size"]
            and r["sliding_window"] is None]
    ax.plot([r["context_len"] for r in rows], [r["bytes"]["token_ids"] / 1024 for r in rows],
            color="black", linestyle=":", label="the request's token ids")
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="KiB per request",
           title="Block-table state (manager lists + runner row)")
    ax.legend(fontsize=7)

    ax = axes[2]
    for block_size in dict.fromkeys(a["block_size"] for a in p["attention"]):
        rows = [a for a in p["attention"] if a["block_size"] == block_size]
        ax.plot([a["context_len"] for a in rows], [a["full_ms"] for a in rows], marker="o",
                label=f"block {block_size}")
        if p["window"]:
            ax.plot([a["context_len"] for a in rows], [a["window_ms"] for a in rows], marker=".",
                    linestyle="--", label=f"block {block_size}, {p['window']}-token window")
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms per layer",
           title="Attention, one decode")
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")
