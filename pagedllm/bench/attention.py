"""`pagedllm bench attention`: the price of paging itself.

The same attention runs on the same numbers four ways: through a paged implementation over KV
cut into blocks whose physical order is shuffled (so every block-table step is a real jump in
memory); through the same implementation with the same blocks in order ("in_order": the table
lookups stay, the jumps go); with one block of L tokens per request ("unpaged": same code, one
table entry per request); and as `F.scaled_dot_product_attention` over the KV laid out
contiguously as [B, H, L, D], the layout a traditional engine keeps. Overhead = paged time /
baseline time - 1: "vs in_order" is what scattering the blocks costs, "vs unpaged" what paging
costs altogether, and "vs SDPA" also mixes in the two kernels' quality. (The vLLM paper reports
20-26% for its GPU kernel against FasterTransformer's contiguous one.) The variants of a case are
timed in interleaved rounds, so load from other processes falls on all of them alike.

Decode (one new token per request, every request at the same context length) and prefill (the
whole context is new, causal) are measured separately. Each paged implementation that can run a
case is measured (the compiled CPU kernel where it is built, and the portable torch reference),
and each case records which of them the public `pagedllm.kernels.attention.paged_attention`, the
function the model calls, dispatched to ("active"). With --kv-cache-dtype int8 / fp8_e4m3 /
fp8_e5m2 the paged layouts hold compressed KV (SDPA keeps the model's dtype, so its "max |diff|"
then includes the quantization error).

It also times what paging costs outside the kernel: the runner's per-step building of the
block-table and slot-mapping tensors (`ModelRunner.prepare_inputs`, with its persistent BlockTable).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

import pagedllm.kernels.attention as attention
from pagedllm.bench.common import add_threads_arg, apply_threads, print_table, timed_functions, write_json
from pagedllm.core.kv.slots import slot_mapping
from pagedllm.kernels.attention import QuantizedKV, cpu_attention, torch_ref
from pagedllm.kernels.attention.metadata import AttentionMetadata
from pagedllm.utils import cdiv

# SmolLM2-135M's attention: 9 query heads, 3 KV heads, head_dim 64, 30 layers.
DEFAULT_SHAPE = {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "num_layers": 30}
PAPER_OVERHEAD_PCT = "20-26% (vLLM paper, GPU kernel)"


@dataclass
class Case:
    """One batch of `batch` requests with `context_len` tokens each, in every layout measured."""

    mode: str  # "decode" or "prefill"
    batch: int
    context_len: int
    query: torch.Tensor  # [T, Hq, D], the model's flat batch
    # layout -> (key_cache, value_cache, metadata), caches [num_blocks, block_size, Hkv, D]:
    # "paged": blocks of block_size in shuffled order; "in_order": the same blocks in order;
    # "unpaged": one block of L tokens per request ([B, L, Hkv, D]). Compressed: QuantizedKVs.
    paged: dict[str, tuple[attention.CacheSide, attention.CacheSide, AttentionMetadata]]
    query_contiguous: torch.Tensor  # [B, Hq, q_len, D]
    key_contiguous: torch.Tensor  # [B, Hkv, L, D]
    value_contiguous: torch.Tensor
    scale: float


def parse_int_list(text: str) -> list[int]:
    """"256,1k,32k,1m" -> [256, 1024, 32768, 1048576]."""
    values = []
    for item in str(text).split(","):
        item = item.strip().lower()
        factor = {"k": 1024, "m": 1024**2}.get(item[-1:], 1)
        try:
            value = int(item.rstrip("km")) * factor
        except ValueError:
            raise ValueError(f"expected a comma-separated list of positive integers like 256,1k,32k; "
                             f"got {text!r}") from None
        if value < 1:
            raise ValueError(f"list values must be positive; got {text!r}")
        values.append(value)
    return values


def shuffled_block_tables(batch: int, blocks_per_seq: int, seed: int) -> torch.Tensor:
    """[batch, blocks_per_seq] int32: every physical block used once, in a random order."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(batch * blocks_per_seq, generator=generator).view(
        batch, blocks_per_seq).to(torch.int32)


def to_paged(kv: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cut contiguous KV [B, L, Hkv, D] into blocks placed as block_tables says:
    returns a cache [B * blocks_per_seq, block_size, Hkv, D]."""
    batch, length, num_kv_heads, head_dim = kv.shape
    blocks_per_seq = block_tables.shape[1]
    padded = kv.new_zeros(batch, blocks_per_seq * block_size, num_kv_heads, head_dim)
    padded[:, :length] = kv
    cache = torch.empty(batch * blocks_per_seq, block_size, num_kv_heads, head_dim, dtype=kv.dtype)
    cache[block_tables.flatten().long()] = padded.view(-1, block_size, num_kv_heads, head_dim)
    return cache


def paged_metadata(block_tables: torch.Tensor, context_len: int, query_len: int,
                   block_size: int) -> AttentionMetadata:
    """Each request has context_len tokens of which the last query_len are new this step."""
    batch = block_tables.shape[0]
    positions = np.tile(np.arange(context_len - query_len, context_len), batch)
    rows = np.repeat(np.arange(batch), query_len)
    slots = slot_mapping(block_tables.numpy(), rows, positions, block_size)
    query_start_loc = [b * query_len for b in range(batch + 1)]
    return AttentionMetadata(
        slot_mapping=torch.from_numpy(slots), block_tables=block_tables,
        seq_lens=torch.full((batch,), context_len, dtype=torch.int32),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens_cpu=[context_len] * batch, query_start_loc_cpu=query_start_loc)


def make_case(mode: str, batch: int, context_len: int, *, num_heads: int, num_kv_heads: int,
              head_dim: int, block_size: int, dtype: torch.dtype, seed: int = 0,
              kv_cache_dtype: str = "auto") -> Case:
    if mode not in ("decode", "prefill"):
        raise ValueError(f"mode must be 'decode' or 'prefill'; got {mode!r}")
    query_len = 1 if mode == "decode" else context_len
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    key, value = randn(batch, context_len, num_kv_heads, head_dim), randn(batch, context_len,
                                                                          num_kv_heads, head_dim)
    query = randn(batch * query_len, num_heads, head_dim)
    blocks_per_seq = cdiv(context_len, block_size)
    shuffled = shuffled_block_tables(batch, blocks_per_seq, seed)
    in_order = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, blocks_per_seq)
    one_block = torch.arange(batch, dtype=torch.int32)[:, None]

    def stored(cache: torch.Tensor) -> attention.CacheSide:
        return cache if kv_cache_dtype == "auto" else QuantizedKV.from_values(cache, kv_cache_dtype)

    return Case(
        mode=mode, batch=batch, context_len=context_len, query=query,
        paged={
            "paged": (stored(to_paged(key, shuffled, block_size)),
                      stored(to_paged(value, shuffled, block_size)),
                      paged_metadata(shuffled, context_len, query_len, block_size)),
            "in_order": (stored(to_paged(key, in_order, block_size)),
                         stored(to_paged(value, in_order, block_size)),
                         paged_metadata(in_order, context_len, query_len, block_size)),
            "unpaged": (stored(key), stored(value),
                        paged_metadata(one_block, context_len, query_len, context_len)),
        },
        query_contiguous=query.view(batch, query_len, num_heads, head_dim).transpose(1, 2).contiguous(),
        key_contiguous=key.transpose(1, 2).contiguous(),
        value_contiguous=value.transpose(1, 2).contiguous(),
        scale=head_dim**-0.5)


def run_paged(case: Case, impl, layout: str = "paged") -> torch.Tensor:
    key_cache, value_cache, meta = case.paged[layout]
    return impl(case.query, key_cache, value_cache, meta, case.scale)


def run_contiguous(case: Case) -> torch.Tensor:
    """The same attention with no paging: one SDPA call over [B, H, L, D]."""
    return F.scaled_dot_product_attention(
        case.query_contiguous, case.key_contiguous, case.value_contiguous,
        is_causal=case.mode == "prefill", scale=case.scale, enable_gqa=True)


def contiguous_as_flat(out: torch.Tensor) -> torch.Tensor:
    """[B, Hq, q_len, D] -> the flat [B * q_len, Hq, D] the paged call returns."""
    return out.transpose(1, 2).flatten(0, 1)


def known_implementations() -> dict[str, object]:
    """The paged attention implementations the attention module has, by name: the compiled CPU
    kernel (pagedllm.kernels.attention.cpu_attention) and the torch reference."""
    impls = {"cpu_kernel": cpu_attention.paged_attention}
    impls["torch_ref"] = torch_ref.paged_attention
    return impls


def implementations(case: Case) -> dict[str, object]:
    """The implementations that can run this case: the kernel where it is built and takes these
    inputs (PAGEDLLM_ATTENTION=torch turns it off), and always the torch reference."""
    impls = known_implementations()
    if "cpu_kernel" in impls:
        if not cpu_attention.supports(case.query, case.paged["paged"][0]):
            del impls["cpu_kernel"]
    return impls


def active_implementation(case: Case, impls: dict[str, object]) -> str:
    """Which of impls the public pagedllm.kernels.attention.paged_attention runs for this case, found by
    calling it once with each implementation timed (the model calls the public function)."""
    with timed_functions(*impls.values()) as timers:
        run_paged(case, attention.paged_attention)
    ran = [name for name, timer in zip(impls, timers) if timer.calls]
    return ran[0] if ran else "paged_attention"


def time_call(fn, min_time_s: float, max_reps: int) -> tuple[float, int]:
    """Median seconds of fn() after one warm-up call; repeats until min_time_s or max_reps."""
    medians, reps = time_interleaved({"call": fn}, min_time_s, max_reps)
    return medians["call"], reps


def time_interleaved(fns: dict[str, object], min_time_s: float,
                     max_reps: int) -> tuple[dict[str, float], int]:
    """Median seconds of each fn, timed in rounds (one call of each per round, after one warm-up
    call each) until every fn had min_time_s or max_reps rounds, and at least 3 rounds."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    rounds = 0
    while rounds < 3 or (min(sum(t) for t in times.values()) < min_time_s and rounds < max_reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    return {name: statistics.median(t) for name, t in times.items()}, rounds


def overhead_pct(paged_s: float, contiguous_s: float) -> float:
    return round(100.0 * (paged_s / contiguous_s - 1.0), 1)


# -- the runner's per-step metadata ---------------------------------------------------------

def stub_runner(block_size: int, max_num_batched_tokens: int, max_model_len: int):
    """A ModelRunner whose prepare_inputs builds every step tensor; its model is never called, so it
    gets a stub with one layer of one block, and no faulting-in of the blocks a step writes (the
    block ids it sees index no real cache)."""
    from pagedllm.worker.runner import ModelRunner

    stub = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1,
                                                  head_dim=1, kv_lora_rank=0, attention_layers=(0,),
                                                  is_hybrid=False))
    runner = ModelRunner(stub, num_blocks=1, block_size=block_size,
                         max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                         kv_dtype=torch.float32)
    runner.touched_blocks = None
    return runner


def make_prepare_runner(batch: int, context_len: int, block_size: int, query_len: int):
    """A stub runner (stub_runner) for batch requests at context_len, plus the scheduled items for
    one step."""
    from pagedllm.core.scheduler import ScheduledRequest

    runner = stub_runner(block_size, batch * query_len, context_len)
    tables = shuffled_block_tables(batch, cdiv(context_len, block_size), seed=1).tolist()
    scheduled = []
    for b in range(batch):
        request = SimpleNamespace(request_id=f"r{b}", token_ids=[1] * context_len,
                                  num_tokens=context_len)
        scheduled.append(ScheduledRequest(request, query_len, context_len - query_len, tables[b],
                                          block_size))
    return runner, scheduled


def time_prepare(batch: int, context_len: int, block_size: int, query_len: int,
                 min_time_s: float, max_reps: int) -> dict:
    """Per-step cost of building input ids, positions, slot mapping and block tables. The first
    call fills each request's block-table row; later calls are the steady state, where only the
    newest block of each row is rewritten."""
    runner, scheduled = make_prepare_runner(batch, context_len, block_size, query_len)
    t0 = time.perf_counter()
    runner.prepare_inputs(scheduled)
    first_s = time.perf_counter() - t0
    steady_s, _ = time_call(lambda: runner.prepare_inputs(scheduled), min_time_s, max_reps)
    return {"prepare_first_ms": round(first_s * 1e3, 4), "prepare_ms": round(steady_s * 1e3, 4)}


# -- the command --------------------------------------------------------------------------------

def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--modes", default="decode,prefill", help="decode, prefill or both")
    parser.add_argument("--contexts", default="256,1k,4k,16k,32k",
                        help="context lengths in tokens (e.g. 256,1k,32k)")
    parser.add_argument("--batches", default="1,8,64", help="batch sizes (requests)")
    parser.add_argument("--max-decode-tokens", default="256k",
                        help="skip decode cases whose batch x context is over this (KV memory)")
    parser.add_argument("--max-prefill-tokens", default="4k",
                        help="skip prefill cases whose batch x context is over this (quadratic time)")
    parser.add_argument("--num-heads", type=int, default=DEFAULT_SHAPE["num_heads"])
    parser.add_argument("--num-kv-heads", type=int, default=DEFAULT_SHAPE["num_kv_heads"])
    parser.add_argument("--head-dim", type=int, default=DEFAULT_SHAPE["head_dim"])
    parser.add_argument("--num-layers", type=int, default=DEFAULT_SHAPE["num_layers"],
                        help="layers per step, to put prepare_inputs' per-step cost next to attention's")
    parser.add_argument("--min-time", type=float, default=0.3,
                        help="seconds to spend timing each call (median of the repeats)")
    parser.add_argument("--max-reps", type=int, default=50)
    add_threads_arg(parser)
    parser.set_defaults(func=main)


def grid(modes: list[str], contexts: list[int], batches: list[int], max_decode_tokens: int,
         max_prefill_tokens: int) -> list[tuple[str, int, int]]:
    """(mode, batch, context) cases, skipping those over the token caps."""
    cap = {"decode": max_decode_tokens, "prefill": max_prefill_tokens}
    return [(mode, batch, ctx) for mode in modes for ctx in contexts for batch in batches
            if batch * ctx <= cap[mode]]


BASELINE_LAYOUTS = ("in_order", "unpaged")


def measure_case(case: Case, min_time_s: float, max_reps: int) -> dict:
    impls = implementations(case)
    active = active_implementation(case, impls)
    if active not in impls:  # the public function runs something this bench does not know
        impls = {active: attention.paged_attention, **impls}
    fns = {"sdpa": lambda: run_contiguous(case)}
    for name, impl in impls.items():
        for layout in ("paged", *BASELINE_LAYOUTS):
            fns[f"{name}/{layout}"] = lambda impl=impl, layout=layout: run_paged(case, impl, layout)
    medians, rounds = time_interleaved(fns, min_time_s, max_reps)
    reference = contiguous_as_flat(run_contiguous(case)).float()
    row = {"mode": case.mode, "batch": case.batch, "context_len": case.context_len,
           "active": active, "rounds": rounds, "contiguous_ms": round(medians["sdpa"] * 1e3, 4),
           "paged": {}}
    for name, impl in impls.items():
        paged_s = medians[f"{name}/paged"]
        error = (run_paged(case, impl).float() - reference).abs().max().item()
        figures = {"ms": round(paged_s * 1e3, 4),
                   "overhead_pct": overhead_pct(paged_s, medians["sdpa"])}
        for layout in BASELINE_LAYOUTS:
            base_s = medians[f"{name}/{layout}"]
            figures[f"{layout}_ms"] = round(base_s * 1e3, 4)
            figures[f"overhead_vs_{layout}_pct"] = overhead_pct(paged_s, base_s)
        row["paged"][name] = {**figures, "max_abs_diff": float(f"{error:.3g}")}
    return row


def main(args: argparse.Namespace) -> int:
    from pagedllm.config import default_block_size
    from pagedllm.model.loader import resolve_dtype

    dtype = resolve_dtype(args.dtype)
    apply_threads(args)
    if args.block_size is None:  # the engine's flag, unset: the device's default page
        args.block_size = default_block_size("cpu")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in modes:
        if mode not in ("decode", "prefill"):
            raise ValueError(f"--modes takes decode and/or prefill; got {mode!r}")
    cases = grid(modes, parse_int_list(args.contexts), parse_int_list(args.batches),
                 parse_int_list(args.max_decode_tokens)[0], parse_int_list(args.max_prefill_tokens)[0])
    shape = {"num_heads": args.num_heads, "num_kv_heads": args.num_kv_heads,
             "head_dim": args.head_dim}
    rows = []
    for mode, batch, ctx in cases:
        case = make_case(mode, batch, ctx, **shape, block_size=args.block_size, dtype=dtype,
                         seed=args.seed, kv_cache_dtype=args.kv_cache_dtype)
        row = measure_case(case, args.min_time, args.max_reps)
        del case
        query_len = 1 if mode == "decode" else ctx
        row.update(time_prepare(batch, ctx, args.block_size, query_len, args.min_time / 3,
                                args.max_reps))
        row["prepare_pct_of_step_attention"] = round(
            100.0 * row["prepare_ms"] / (args.num_layers * row["paged"][row["active"]]["ms"]), 2)
        rows.append(row)
        _print_row(row)
    names = list(dict.fromkeys(name for r in rows for name in r["paged"]))
    payload = {"implementations": names,
               "active_implementations": sorted({r["active"] for r in rows}),
               "dtype": str(dtype).removeprefix("torch."), "kv_cache_dtype": args.kv_cache_dtype,
               "block_size": args.block_size,
               "num_threads": torch.get_num_threads(), **shape, "num_layers": args.num_layers,
               "paper_overhead": PAPER_OVERHEAD_PCT, "summary": summarize(rows), "cases": rows}
    _print(payload)
    write_json(args.output_json, payload)
    return 0


def summarize(rows: list[dict]) -> dict:
    """Per implementation (and "active": whichever the public function ran in each case), mode
    and baseline: the geometric mean over the cases of paged time / baseline time, as an overhead
    %, and its range. Baselines: "vs_contiguous_sdpa" (SDPA over [B, H, L, D]), "vs_in_order"
    and "vs_unpaged" (the same implementation over in-order blocks, over one block per request)."""
    series: dict[tuple[str, str, str], list[float]] = {}
    for r in rows:
        for name, p in [*r["paged"].items(), ("active", r["paged"][r["active"]])]:
            bases = [("vs_contiguous_sdpa", r["contiguous_ms"])]
            bases += [(f"vs_{layout}", p.get(f"{layout}_ms", 0.0)) for layout in BASELINE_LAYOUTS]
            for baseline, base_ms in bases:
                if base_ms > 0:
                    series.setdefault((name, r["mode"], baseline), []).append(p["ms"] / base_ms)
    summary: dict = {}
    for (name, mode, baseline), ratios in series.items():
        geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        summary.setdefault(name, {}).setdefault(mode, {})[baseline] = {
            "geomean_overhead_pct": round(100.0 * (geo - 1.0), 1),
            "min_overhead_pct": round(100.0 * (min(ratios) - 1.0), 1),
            "max_overhead_pct": round(100.0 * (max(ratios) - 1.0), 1),
            "num_cases": len(ratios)}
    return summary


def _print_row(row: dict) -> None:
    paged = ", ".join(f"{name} {p['ms']} ms ({p['overhead_vs_in_order_pct']:+}% vs in order, "
                      f"{p['overhead_vs_unpaged_pct']:+}% vs unpaged, {p['overhead_pct']:+}% vs SDPA)"
                      for name, p in row["paged"].items())
    print(f"{row['mode']:7} B={row['batch']:<3} L={row['context_len']:<6} SDPA "
          f"{row['contiguous_ms']} ms; paged {paged}; active {row['active']}; "
          f"prepare_inputs {row['prepare_ms']} ms", flush=True)


def _print(p: dict) -> None:
    header = ["mode", "batch", "context", "SDPA ms"]
    for name in p["implementations"]:
        header += [f"{name} ms", "vs in order", "vs unpaged", "vs SDPA", "max |diff|"]
    header += ["active", "prepare_inputs ms", "prepare_inputs / step attn"]
    rows = []
    for r in p["cases"]:
        row = [r["mode"], r["batch"], r["context_len"], r["contiguous_ms"]]
        for name in p["implementations"]:
            q = r["paged"].get(name)
            row += ([q["ms"], f"{q['overhead_vs_in_order_pct']:+}%", f"{q['overhead_vs_unpaged_pct']:+}%",
                     f"{q['overhead_pct']:+}%", q["max_abs_diff"]] if q else ["-"] * 5)
        row += [r["active"], r["prepare_ms"], f"{r['prepare_pct_of_step_attention']}%"]
        rows.append(row)
    print_table(f"Attention over paged vs contiguous KV ({p['dtype']}, KV {p['kv_cache_dtype']}, "
                f"block {p['block_size']}, {p['num_threads']} threads)", header, rows)
    for name, modes in p["summary"].items():
        for mode, baselines in modes.items():
            text = "; ".join(f"{s['geomean_overhead_pct']:+}% {baseline.replace('_', ' ')} "
                             f"({s['min_overhead_pct']:+}% to {s['max_overhead_pct']:+}%)"
                             for baseline, s in baselines.items())
            print(f"{name} {mode} (geometric mean of {next(iter(baselines.values()))['num_cases']} "
                  f"cases): {text}")
    print(f"vLLM paper: {p['paper_overhead']}")
