"""`pagedllm bench tensor-parallel`: the same workload at several tensor_parallel_sizes, on the
same cores (each size's ranks share them out: on 2 cores, size 1 runs 2 torch threads, size 2 one
each): throughput, time per step, and rank 0's time in all-reduces and bytes broadcast per step;
then a model of what crosses the network per step for large models (docs/distributed.md).

Sizes run in turn, --repeats times each (an engine each time: its workers are part of what it
costs), and greedy outputs are compared with the first size's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.bench.common import (
    add_threads_arg,
    apply_threads,
    engine_config,
    print_table,
    run_workload,
    serve_one,
    write_json,
)
from pagedllm.bench.workload import load_workload, summarize
from pagedllm.engine.llm_engine import LLMEngine

# (name, hidden size, layers, vocabulary) of the models in the communication table.
LARGE_MODELS = [("Llama-2-7B", 4096, 32, 32000), ("Llama-2-70B", 8192, 80, 32000)]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="1,2", help="tensor_parallel_size values, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    add_threads_arg(parser)  # the cores the sizes share out (--threads 1: one thread each)
    parser.set_defaults(func=main, num_prompts=16, input_len="64-128", output_len="32-64")


def main(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in args.sizes.split(",")]
    apply_threads(args)
    cores = torch.get_num_threads()
    runs: dict[int, list[dict]] = {size: [] for size in sizes}
    outputs: dict[int, list[list[int]]] = {}
    workload = None
    for _ in range(args.repeats):
        for size in sizes:
            torch.set_num_threads(cores)  # each engine shares the same cores out again
            engine = LLMEngine(engine_config(args, tensor_parallel_size=size))
            workload = workload or load_workload(engine.tokenizer, args.dataset, args.num_prompts,
                                                 args.input_len, args.output_len, args.seed)
            serve_one(engine)
            runs[size].append(_measure(engine, workload))
            outputs[size] = runs[size][-1].pop("token_ids")
            _close(engine)
    rows, payload = [], {"workload": summarize(workload), "cores": cores, "sizes": {}}
    for size in sizes:
        median = {key: statistics.median(r[key] for r in runs[size]) for key in runs[size][0]}
        spread = [r["output_tokens_per_s"] for r in runs[size]]
        median["same_greedy_output_as_first_size"] = outputs[size] == outputs[sizes[0]]
        payload["sizes"][size] = {**median, "output_tokens_per_s_runs": spread}
        rows.append([size, median["torch_threads"], median["output_tokens_per_s"],
                     f"{min(spread)}-{max(spread)}", median["step_ms"],
                     median["all_reduce_ms_per_step"], median["all_reduces_per_step"],
                     median["broadcast_bytes_per_step"], median["same_greedy_output_as_first_size"]])
    print_table(f"The same workload at each tensor_parallel_size, {cores} torch threads shared "
                f"out (medians of {args.repeats} runs)",
                ["size", "threads/rank", "out tok/s", "range", "ms/step", "all-reduce ms/step",
                 "all-reduces/step", "broadcast B/step", "same output"], rows)
    payload["communication_model"] = communication_model()
    print_table("What crosses the network per step (model): bf16 activations, per all-reduce "
                "tokens x hidden x 2 bytes, 2 per layer + 1 (embedding)",
                ["model", "ranks", "tokens", "all-reduces", "all-reduce MiB", "ring MiB sent/rank",
                 "logits gather MiB", "packet KiB"],
                [[m["model"], m["ranks"], m["tokens"], m["all_reduces"], m["all_reduce_mib"],
                  m["ring_mib_sent_per_rank"], m["logits_gather_mib"], m["packet_kib"]]
                 for m in payload["communication_model"]])
    write_json(args.output_json, payload)
    return 0


def _measure(engine: LLMEngine, workload) -> dict:
    """One run of the workload; rank 0's collective counters read before and after."""
    driver = engine.engine_core.executor.driver
    group = driver.group if driver is not None else None
    before = (group.all_reduce_s, group.num_all_reduces, driver.bytes_sent) if group else (0.0, 0, 0)
    steps_before = driver.num_steps if driver else 0
    started = time.perf_counter()
    result = run_workload(engine, workload, record_steps=True, tag="tp")
    elapsed = time.perf_counter() - started
    num_steps = max(1, len(result.steps))
    if group is not None:
        reduce_s = group.all_reduce_s - before[0]
        reduces = group.num_all_reduces - before[1]
        sent = driver.bytes_sent - before[2]
        num_steps = max(1, driver.num_steps - steps_before)
    else:
        reduce_s, reduces, sent = 0.0, 0, 0
    return {"torch_threads": torch.get_num_threads(),
            "output_tokens_per_s": round(result.output_tokens / elapsed, 2),
            "step_ms": round(1000 * elapsed / num_steps, 2),
            "all_reduce_ms_per_step": round(1000 * reduce_s / num_steps, 3),
            "all_reduces_per_step": round(reduces / num_steps, 1),
            "broadcast_bytes_per_step": round(sent / num_steps),
            "token_ids": result.token_ids}


def _close(engine: LLMEngine) -> None:
    driver = engine.engine_core.executor.driver
    if driver is not None:
        driver.close()


def communication_model(dtype_bytes: int = 2) -> list[dict]:
    """Bytes per step of a decode step of 64 sequences and a prefill chunk of 2048 tokens, for the
    LARGE_MODELS at 2, 4 and 8 ranks. An all-reduce of N bytes sends 2 (ranks - 1) / ranks * N
    from each rank in a ring (gloo's and NCCL's algorithm for large tensors); the logits gather
    sends each worker's vocabulary share of float32 logits of the sampled rows to rank 0; the
    packet is rank 0's broadcast (header, 3 int64 a token, about 3 int64 a sequence)."""
    rows = []
    for name, hidden, layers, vocab in LARGE_MODELS:
        for ranks in (2, 4, 8):
            for tokens, seqs in ((64, 64), (2048, 1)):
                all_reduces = 2 * layers + 1
                reduce_bytes = all_reduces * tokens * hidden * dtype_bytes
                gather_bytes = seqs * vocab * 4 * (ranks - 1) / ranks
                packet = 8 * (8 + 3 * tokens + seqs + 2 * seqs + 1 + 2 * seqs)
                rows.append({"model": name, "ranks": ranks, "tokens": tokens,
                             "all_reduces": all_reduces,
                             "all_reduce_mib": round(reduce_bytes / 2**20, 1),
                             "ring_mib_sent_per_rank": round(
                                 reduce_bytes * 2 * (ranks - 1) / ranks / 2**20, 1),
                             "logits_gather_mib": round(gather_bytes / 2**20, 2),
                             "packet_kib": round(packet / 2**10, 1)})
    return rows
