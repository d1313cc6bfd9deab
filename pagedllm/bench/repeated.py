"""`pagedllm bench repeated`: speculative decoding on repeated work, suffix decoding's case.

Agents and pipelines send the same request again (a retry, the next round of a loop, near-copies
of one job): its answer repeats an earlier request's output, which suffix decoding's tree over
earlier outputs proposes whole and prompt lookup (n-gram), which reads only the request's own
tokens, does not. Each of --num-prompts copy-workload requests (bench throughput's --workload
copy) is sent once and then again, one request at a time; the repeat's generated tokens over its
wall time are its speed (the prefix cache serves every engine's repeat prompt alike). The engines
(plain, n-gram with lookup 2-5, suffix; k tokens proposed at most) are built once, each with its
own weights (a model shared by engines runs its one-call decode for the last one's KV cache
alone), and take each request in turn, so a shared machine's drift falls on all alike.
(Greedy, but in bf16 a repeat may part from its first answer: its prompt's cached blocks leave
a shorter prefill, whose sums run in another order; --batch-invariant makes them equal.)
"""

from __future__ import annotations

import argparse
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
from pagedllm.bench.throughput import cpu_tier_fields
from pagedllm.bench.workload import copy_workload
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams


def add_args(parser: argparse.ArgumentParser) -> None:
    add_threads_arg(parser)
    parser.add_argument("--k", type=int, default=4, help="tokens proposed per step at most")
    parser.set_defaults(func=main, num_prompts=9)


def methods(k: int) -> dict[str, dict | None]:
    """Each engine's speculative_config, by name."""
    return {"plain": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                      "prompt_lookup_max": 5},
            "suffix": {"method": "suffix", "num_speculative_tokens": k}}


def answer(engine: LLMEngine, prompt_token_ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    """One request served alone: its tokens and wall seconds."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    engine.add_request("repeated", {"prompt_token_ids": prompt_token_ids}, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens = list(output.outputs[0].token_ids)
    return tokens, time.perf_counter() - started


def main(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or args.k < 1:
        raise SystemExit("bench repeated: --num-prompts and --k must be at least 1")
    apply_threads(args)
    engines = {name: LLMEngine(engine_config(args, speculative_config=spec))
               for name, spec in methods(args.k).items()}
    for engine in engines.values():
        serve_one(engine)
    requests = copy_workload(next(iter(engines.values())).tokenizer, args.num_prompts)
    speeds: dict[str, list[float]] = {name: [] for name in engines}
    for request in requests:
        for name, engine in engines.items():
            answer(engine, request.prompt_token_ids, request.max_tokens)
            again, seconds = answer(engine, request.prompt_token_ids, request.max_tokens)
            speeds[name].append(len(again) / seconds)
    medians = {name: statistics.median(values) for name, values in speeds.items()}
    print_table(f"Repeated work: {args.num_prompts} copy requests, each sent twice, one at a time; the "
                f"repeat's generated tok/s (k <= {args.k})",
                ["engine", "median tok/s", "against n-gram", "against plain", "each repeat"],
                [[name, round(medians[name], 1), f"{medians[name] / medians['ngram']:.3f}x",
                  f"{medians[name] / medians['plain']:.3f}x", [round(v, 1) for v in speeds[name]]]
                 for name in engines])
    write_json(args.output_json, {"bench": "repeated", "k": args.k, "num_prompts": args.num_prompts,
                                  **cpu_tier_fields(engines["plain"].device), "tokens_per_s": speeds,
                                  "medians": medians})
    return 0
