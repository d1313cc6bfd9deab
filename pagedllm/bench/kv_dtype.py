"""`pagedllm bench kv-dtype`: what compressing the KV cache buys and what it costs, one row per
kv_cache_dtype, on one model and one workload.

- Capacity: bytes per token (all layers, keys and values, scales included); the blocks a KV
  budget of --capacity-memory buys; and the most requests running at once when
  --capacity-prompts requests of the workload's lengths arrive together (scheduler and KV
  manager only, as `bench memory --simulate` runs them, with no cap on sequences or batched
  tokens: memory decides). A float32 row (a float32 model's own KV) is added for reference.
- Decode attention: ms per call of the public paged_attention (the function the model calls)
  over a decode batch built as `bench attention` builds it, every dtype timed in interleaved
  rounds so load from other processes falls on all of them alike.
- Generated tokens/s of the engine on the workload (greedy, ignore_eos): the best of --repeats
  runs, the dtypes' runs alternating.
- Quality: the model's perplexity on the held-out text (pagedllm/data/heldout.txt, unlike the
  prompts' corpus) read through a cache of that dtype, and greedy agreement with auto: the share
  of requests whose first --agreement-tokens generated tokens equal auto's, and how many leading
  tokens are equal on average (a greedy sequence that parts once never meets again, so the share
  is a strict figure: the prefix says how early they part).
"""

from __future__ import annotations

import argparse

from pagedllm.bench.attention import make_case, parse_int_list, time_interleaved
from pagedllm.bench.common import (
    add_threads_arg,
    apply_threads,
    engine_config,
    print_table,
    run_workload,
    serve_one,
    shared_model_loads,
    write_json,
)
from pagedllm.bench.memory import simulate_workload, simulated_scheduler
from pagedllm.bench.perplexity import heldout_text, perplexity
from pagedllm.bench.workload import load_workload, summarize
from pagedllm.config import canonical_kv_cache_dtype, parse_size
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.kernels.attention import allocate_kv_cache, kv_cache_bytes_per_block, paged_attention
from pagedllm.utils import cdiv

REFERENCE = "float32"  # capacity-only row: the KV cache of a float32 model


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-dtypes", default="auto,int8,fp8_e4m3,fp8_e5m2",
                        help="kv_cache_dtypes to compare (auto first: the others are compared to it)")
    parser.add_argument("--capacity-memory", default="1GiB",
                        help="the KV byte budget every dtype gets for the capacity figures")
    parser.add_argument("--capacity-prompts", type=int, default=2048,
                        help="requests arriving at once in the capacity simulation")
    parser.add_argument("--attention-batch", type=int, default=16, help="decode batch (requests)")
    parser.add_argument("--attention-contexts", default="256,1k,4k", help="decode context lengths")
    parser.add_argument("--min-time", type=float, default=0.5,
                        help="seconds to spend timing each decode-attention call")
    parser.add_argument("--max-reps", type=int, default=100)
    parser.add_argument("--ppl-tokens", type=int, default=2048,
                        help="held-out tokens scored for perplexity (0: skip perplexity)")
    parser.add_argument("--ppl-context", type=int, default=1024, help="perplexity window (tokens)")
    parser.add_argument("--agreement-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed runs of the workload per dtype, alternating (the best counts)")
    parser.add_argument("--plot", default="bench-out/kv_dtype.png", help="PNG path ('' for none)")
    add_threads_arg(parser)
    parser.set_defaults(func=main, num_prompts=16, input_len="64-256", output_len="64",
                        max_model_len=1024, kv_cache_memory="256MiB", block_size=16)


def kv_dtypes(text: str) -> list[str]:
    """The list --kv-dtypes names, canonical ("fp8" -> "fp8_e4m3"), each once, auto first."""
    names = list(dict.fromkeys(canonical_kv_cache_dtype(n.strip()) for n in text.split(",") if n.strip()))
    if not names:
        raise ValueError("--kv-dtypes names no kv_cache_dtype")
    return sorted(names, key=lambda n: n != "auto")


def capacity(args: argparse.Namespace, model_config, model_dtype, workload_lengths) -> dict:
    """Per dtype (and the float32 reference): bytes per token, blocks in the budget, and the most
    requests the scheduler ran at once (simulated)."""
    import torch

    budget = parse_size(args.capacity_memory)
    # Neither the sequence cap nor the step's token budget limits admission: only memory does.
    sim_args = argparse.Namespace(**{**vars(args), "max_num_seqs": args.capacity_prompts,
                                     "max_num_batched_tokens": args.capacity_prompts * args.max_model_len})
    rows = {}
    for name in [REFERENCE, *kv_dtypes(args.kv_dtypes)]:
        dtype, kv = (torch.float32, "auto") if name == REFERENCE else (model_dtype, name)
        bytes_per_block = kv_cache_bytes_per_block(
            model_config.num_hidden_layers, args.block_size, model_config.num_key_value_heads,
            model_config.head_dim, dtype, kv)
        num_blocks = budget // bytes_per_block
        run = simulate_workload(simulated_scheduler(sim_args, "paged", args.max_model_len, num_blocks),
                                workload_lengths)
        rows[name] = {"bytes_per_token": bytes_per_block // args.block_size, "num_blocks": num_blocks,
                      "max_running": max(s.running for s in run.steps)}
    return rows


def decode_attention(args: argparse.Namespace, model_config, model_dtype) -> dict:
    """Per dtype and context: ms per decode-attention call, all dtypes interleaved."""
    shape = {"num_heads": model_config.num_attention_heads,
             "num_kv_heads": model_config.num_key_value_heads, "head_dim": model_config.head_dim}
    times: dict[str, dict[int, float]] = {name: {} for name in kv_dtypes(args.kv_dtypes)}
    for context_len in parse_int_list(args.attention_contexts):
        cases = {name: make_case("decode", args.attention_batch, context_len, **shape,
                                 block_size=args.block_size, dtype=model_dtype, seed=args.seed,
                                 kv_cache_dtype=name)
                 for name in times}
        calls = {name: (lambda c=case: paged_attention(c.query, *c.paged["paged"], c.scale))
                 for name, case in cases.items()}
        medians, _ = time_interleaved(calls, args.min_time, args.max_reps)
        for name, seconds in medians.items():
            times[name][context_len] = round(seconds * 1e3, 4)
    return times


def quality(engine: LLMEngine, args: argparse.Namespace, ppl_ids: list[int]) -> dict:
    """Perplexity of the engine's model on ppl_ids through a cache of the engine's KV dtype."""
    if not ppl_ids:
        return {}
    mc = engine.model_config
    caches = allocate_kv_cache(mc.num_hidden_layers, cdiv(args.ppl_context, args.block_size),
                               args.block_size, mc.num_key_value_heads, mc.head_dim, engine.dtype,
                               engine.device, kv_cache_dtype=engine.config.kv_cache_dtype)
    result = perplexity(engine.engine_core.executor.runner.model, caches, args.block_size, ppl_ids,
                        context_len=args.ppl_context)
    return {"perplexity": round(result.perplexity, 4), "ppl_scored_tokens": result.num_scored_tokens}


def agreement(outputs: list[list[int]], reference: list[list[int]], num_tokens: int) -> dict:
    """Against the reference's greedy outputs: the share of requests whose first num_tokens are
    identical, and the mean number of leading tokens that are (of num_tokens)."""
    prefixes, same = [], 0
    for out, ref in zip(outputs, reference, strict=True):
        out, ref = out[:num_tokens], ref[:num_tokens]
        same += out == ref
        parted = (i for i, (a, b) in enumerate(zip(out, ref)) if a != b)
        prefixes.append(next(parted, min(len(out), len(ref))))
    return {"greedy_agreement": round(same / len(reference), 4),
            "greedy_common_prefix": round(sum(prefixes) / len(prefixes), 2)}


def main(args: argparse.Namespace) -> int:
    apply_threads(args)
    names = kv_dtypes(args.kv_dtypes)
    with shared_model_loads():  # one model load for every engine
        # Every engine at once (their KV costs memory only as blocks get used), so the timed runs
        # can alternate between them: load from other processes then falls on every dtype alike.
        engines = {name: LLMEngine(engine_config(args, kv_cache_dtype=name, enable_prefix_caching=False))
                   for name in names}
    first = engines[names[0]]
    tokenizer, model_config, model_dtype = first.tokenizer, first.model_config, first.dtype
    workload = load_workload(tokenizer, args.dataset, args.num_prompts, args.input_len, args.output_len,
                             args.seed)
    outputs: dict[str, list[list[int]]] = {}
    tokens_per_s: dict[str, list[float]] = {name: [] for name in names}
    for engine in engines.values():
        serve_one(engine)  # first-call costs stay off the clock
    for round_index in range(args.repeats):
        for name, engine in engines.items():
            run = run_workload(engine, workload, tag=f"round{round_index}")
            tokens_per_s[name].append(run.rates()["output_tokens_per_s"])
            outputs.setdefault(name, run.token_ids)
    ppl_ids = tokenizer.encode(heldout_text())[:args.ppl_tokens] if args.ppl_tokens else []
    rows = {}
    for name, engine in engines.items():
        rows[name] = {"kv_cache_dtype": engine.memory_stats()["kv_cache_dtype"],
                      "output_tokens_per_s": max(tokens_per_s[name]),
                      "output_tokens_per_s_runs": tokens_per_s[name], **quality(engine, args, ppl_ids)}
        if "auto" in outputs:
            rows[name].update(agreement(outputs[name], outputs["auto"], args.agreement_tokens))
    del engines, first
    capacity_workload = load_workload(tokenizer, args.dataset, args.capacity_prompts, args.input_len,
                                      args.output_len, args.seed)
    capacity_rows = capacity(args, model_config, model_dtype, capacity_workload)
    attention_ms = decode_attention(args, model_config, model_dtype)
    for name in names:
        rows[name].update(capacity_rows[name], decode_attention_ms=attention_ms[name])
    payload = {"model_dtype": str(model_dtype).removeprefix("torch."), "block_size": args.block_size,
               "workload": summarize(workload), "repeats": args.repeats,
               "capacity_memory": args.capacity_memory, "capacity_prompts": args.capacity_prompts,
               "attention_batch": args.attention_batch, "agreement_tokens": args.agreement_tokens,
               "reference": {REFERENCE: capacity_rows[REFERENCE]}, "rows": rows,
               "ratios": ratios(rows, capacity_rows)}
    _print(payload)
    if args.plot:
        _plot(payload, args.plot)
    write_json(args.output_json, payload)
    return 0


def ratios(rows: dict[str, dict], capacity_rows: dict[str, dict]) -> dict:
    """Per dtype, against auto: max running requests (and against float32 KV), decode-attention
    time per context, perplexity change in %."""
    out = {}
    auto = rows.get("auto")
    for name, row in rows.items():
        r = {"max_running_vs_float32": round(row["max_running"] / capacity_rows[REFERENCE]["max_running"], 2)}
        if auto is not None:
            r["max_running_vs_auto"] = round(row["max_running"] / auto["max_running"], 2)
            r["decode_attention_vs_auto"] = {ctx: round(ms / auto["decode_attention_ms"][ctx], 3)
                                             for ctx, ms in row["decode_attention_ms"].items()}
            if "perplexity" in row:
                r["perplexity_change_pct"] = round(100 * (row["perplexity"] / auto["perplexity"] - 1), 2)
        out[name] = r
    return out


def _print(p: dict) -> None:
    contexts = list(next(iter(p["rows"].values()))["decode_attention_ms"])
    header = ["KV dtype", "bytes/token", "blocks", "max running", "vs auto", "vs fp32"]
    header += [f"decode attn ms L={ctx}" for ctx in contexts]
    header += ["out tok/s", "perplexity", "ppl vs auto", "greedy same", "same prefix"]
    table = []
    for name, row in p["rows"].items():
        r = p["ratios"][name]
        line = [f"{name} ({row['kv_cache_dtype']})" if name == "auto" else name, row["bytes_per_token"],
                row["num_blocks"], row["max_running"], r.get("max_running_vs_auto", "-"),
                r["max_running_vs_float32"]]
        line += [f"{ms} ({r['decode_attention_vs_auto'][ctx]}x)" if "decode_attention_vs_auto" in r else ms
                 for ctx, ms in row["decode_attention_ms"].items()]
        line += [row["output_tokens_per_s"], row.get("perplexity", "-"),
                 f"{r['perplexity_change_pct']:+}%" if "perplexity_change_pct" in r else "-",
                 row.get("greedy_agreement", "-"), row.get("greedy_common_prefix", "-")]
        table.append(line)
    ref = p["reference"][REFERENCE]
    table.append([f"{REFERENCE} (reference)", ref["bytes_per_token"], ref["num_blocks"], ref["max_running"],
                  "-", 1.0] + ["-"] * (len(header) - 6))
    print_table(f"KV cache dtypes (model {p['model_dtype']}, block {p['block_size']}, "
                f"{p['workload']['num_requests']} requests; capacity: {p['capacity_prompts']} requests in "
                f"{p['capacity_memory']}; decode attention: batch {p['attention_batch']})", header, table)


def _plot(p: dict, path: str) -> None:
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(p["rows"])
    rows = [p["rows"][n] for n in names]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    panels = [
        ("max running requests\n(same KV budget)", [r["max_running"] for r in rows]),
        (f"decode attention ms\n(L={max(rows[0]['decode_attention_ms'])})",
         [r["decode_attention_ms"][max(r["decode_attention_ms"])] for r in rows]),
        ("generated tokens/s", [r["output_tokens_per_s"] for r in rows]),
        ("perplexity (held-out text)", [r.get("perplexity", 0.0) for r in rows]),
    ]
    for ax, (title, values) in zip(axes, panels):
        bars = ax.bar(names, values, color=["tab:gray"] + ["tab:blue"] * (len(names) - 1))
        ax.bar_label(bars, fmt="%.4g", fontsize=8)
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
    low = min(r.get("perplexity", 0.0) for r in rows)
    if low:
        axes[3].set_ylim(low * 0.97, max(r["perplexity"] for r in rows) * 1.01)
    fig.suptitle(f"KV cache dtypes, model {p['model_dtype']}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")
