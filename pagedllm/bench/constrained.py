"""`pagedllm bench constrained`: what a grammar constraint costs the engine, end to end.

The same workload runs free and constrained to a JSON schema, in alternating runs (so load on a
shared machine falls on both alike): generated tokens/s of N requests each way, and the ratio.
The constraint is an array of at least 100 objects of `pagedllm bench structured`'s schema
(nested objects, enums, bounded numbers, patterns), so no constrained request can end before
its max_tokens: both runs generate exactly the same number of tokens (free ones use ignore_eos).
Then, at 1, 16 and 64 requests, the mean time of a step free and constrained and the part of it
spent filling and applying the token bitmask (EngineCore's mask_logits, timed), so the cost per
step can be read against the model's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass

from pagedllm.bench.common import (
    CallTimer,
    add_threads_arg,
    apply_threads,
    engine_config,
    print_table,
    run_workload,
    serve_one,
    write_json,
)
from pagedllm.bench.structured import SCHEMA
from pagedllm.bench.workload import load_workload, random_workload, summarize
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.structured.spec import GrammarSpec

# An answer that cannot be complete within any max_tokens here: every request runs to the end.
CONSTRAINT = GrammarSpec.json_schema({"type": "array", "items": SCHEMA, "minItems": 100})


@dataclass
class Run:
    constrained: bool
    num_requests: int
    output_tokens: int
    elapsed_s: float
    num_steps: int
    mask_s: float  # in mask_logits: filling the bitmask from the matchers and applying it

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def step_ms(self) -> float:
        return 1e3 * self.elapsed_s / self.num_steps

    @property
    def mask_ms(self) -> float:
        return 1e3 * self.mask_s / self.num_steps


def run_once(engine: LLMEngine, workload, constrained: bool, tag: str) -> Run:
    core = engine.engine_core
    timer = CallTimer()
    original = core.structured.mask_logits
    core.structured.mask_logits = timer.wrap(original)
    steps = 0

    def count(_: float) -> None:
        nonlocal steps
        steps += 1

    try:
        result = run_workload(engine, workload, tag=tag, on_step=count,
                              structured_outputs=CONSTRAINT if constrained else None)
    finally:
        core.structured.mask_logits = original
    if result.output_tokens != sum(r.max_tokens for r in workload):
        raise RuntimeError("a request ended before its max_tokens: the runs are not comparable")
    # mask_logits also runs (and returns at once) in free runs: only constrained time counts.
    return Run(constrained, len(workload), result.output_tokens, result.elapsed_s, steps,
               timer.seconds if constrained else 0.0)


def alternate(engine: LLMEngine, workload, repeats: int, tag: str) -> tuple[list[Run], list[Run]]:
    """repeats runs each way, free and constrained in turn."""
    free, constrained = [], []
    for i in range(repeats):
        free.append(run_once(engine, workload, False, f"{tag}-free{i}"))
        constrained.append(run_once(engine, workload, True, f"{tag}-json{i}"))
    return free, constrained


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs each way")
    parser.add_argument("--step-sizes", default="1,16,64",
                        help="request counts for the per-step cost (32 prompt, 32 output tokens)")
    add_threads_arg(parser)
    parser.set_defaults(func=main, num_prompts=64, input_len="32-256", output_len="128")


def main(args: argparse.Namespace) -> int:
    apply_threads(args)
    # Constrained steps take no decode bursts; free ones would (pagedllm.engine.decode_burst): off,
    # so that both runs step alike and the ratio is the masks' cost alone.
    engine = LLMEngine(engine_config(args, decode_burst=1))
    serve_one(engine)
    started = time.perf_counter()
    engine.grammar_compiler.compile(CONSTRAINT)
    compile_s = time.perf_counter() - started
    workload = load_workload(engine.tokenizer, args.dataset, args.num_prompts, args.input_len,
                             args.output_len, args.seed)
    free, constrained = alternate(engine, workload, args.repeats, "tput")
    ratios = [c.tokens_per_s / f.tokens_per_s for f, c in zip(free, constrained)]
    print_table(f"Generated tokens/s, {len(workload)} requests free against constrained to a JSON schema "
                f"({summarize(workload)})", ["run", "free tok/s", "constrained tok/s", "ratio"],
                [[i, round(f.tokens_per_s, 1), round(c.tokens_per_s, 1), round(r, 3)]
                 for i, (f, c, r) in enumerate(zip(free, constrained, ratios))])
    steps = []
    for size in (int(n) for n in args.step_sizes.split(",")):
        small = random_workload(engine.tokenizer, size, 32, 32, args.seed)
        steps.append((size, *alternate(engine, small, args.repeats, f"step{size}")))
    rows = []
    for size, free_runs, json_runs in steps:
        free_ms = statistics.fmean(r.step_ms for r in free_runs)
        json_ms = statistics.fmean(r.step_ms for r in json_runs)
        mask_ms = statistics.fmean(r.mask_ms for r in json_runs)
        rows.append([size, round(free_ms, 1), round(json_ms, 1), round(mask_ms, 2),
                     f"{100 * mask_ms / json_ms:.1f}%", f"{100 * (json_ms / free_ms - 1):+.1f}%"])
    print_table("Mean step time (32 prompt + 32 output tokens per request; mask = fill + apply)",
                ["requests", "free ms", "constrained ms", "mask ms", "mask share", "step change"], rows)
    print(f"\nschema compile (once per schema): {1e3 * compile_s:.1f} ms; "
          f"throughput ratio constrained/free: mean {statistics.fmean(ratios):.3f}, "
          f"range {min(ratios):.3f}-{max(ratios):.3f}")
    write_json(args.output_json, {
        "workload": summarize(workload), "compile_ms": round(1e3 * compile_s, 1),
        "throughput": {"free": [asdict(r) for r in free], "constrained": [asdict(r) for r in constrained],
                       "ratios": [round(r, 4) for r in ratios]},
        "steps": [{"requests": size, "free": [asdict(r) for r in f], "constrained": [asdict(r) for r in c]}
                  for size, f, c in steps]})
    return 0
