"""The ways `bench throughput` drives a system over requests, each run the same way for pagedllm
and for every baseline that takes part in it:

- batched: every request of the workload added at once (a server's view: throughput);
- sequential: the same workload one request at a time (a single user's session);
- single_stream: a few requests (by default a 128-token prompt and 256 generated tokens) one at
  a time, each timed on its own: time to first token and decode tokens/s (llama.cpp's home
  ground).

All greedy, every request generating exactly its max_tokens (EOS ignored). Besides wall time, a
stream records the CPU time its system's process spent decoding (all its threads): on a shared
machine wall time shows the load as much as the system, CPU time far less.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from pagedllm.bench.common import run_workload
from pagedllm.bench.workload import BenchRequest, copy_workload, random_workload
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams

SCENARIOS = ("batched", "sequential", "single_stream")


def single_stream_requests(tokenizer, runs: int, prompt_tokens: int, output_tokens: int,
                           seed: int, workload: str = "default") -> list[BenchRequest]:
    """One request per run, each with its own prompt (so no run hits a cache another filled); for
    the copy workload, copy requests (their lengths their own: edit, refactor, json in turn)."""
    if workload == "copy":
        return copy_workload(tokenizer, runs, seed + 1)
    return random_workload(tokenizer, runs, prompt_tokens, output_tokens, seed + 1)


@dataclass
class StreamTiming:
    """One request served alone: seconds to its first token, and for the rest (wall time, and the
    CPU time of the serving process where known)."""

    ttft_s: float
    decode_s: float
    output_tokens: int
    decode_cpu_s: float | None = None

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.output_tokens - 1) / max(self.decode_s, 1e-9)

    @property
    def decode_cpu_ms_per_token(self) -> float | None:
        if self.decode_cpu_s is None:
            return None
        return 1000 * self.decode_cpu_s / max(self.output_tokens - 1, 1)


def summarize_streams(timings: list[StreamTiming]) -> dict:
    rates = [t.decode_tokens_per_s for t in timings]
    ttfts = [t.ttft_s * 1000 for t in timings]
    summary = {"runs": len(timings), "decode_tokens_per_s_best": round(max(rates), 2),
               "decode_tokens_per_s_median": round(statistics.median(rates), 2),
               "decode_tokens_per_s_each": [round(r, 2) for r in rates],
               "ttft_ms_best": round(min(ttfts), 1), "ttft_ms_median": round(statistics.median(ttfts), 1)}
    cpu = [t.decode_cpu_ms_per_token for t in timings]
    if None not in cpu:
        summary.update(decode_cpu_ms_per_token_median=round(statistics.median(cpu), 2),
                       decode_cpu_ms_per_token_each=[round(c, 2) for c in cpu])
    return summary


def summarize_run(elapsed_s: float, requests: list[BenchRequest], cpu_s: float | None = None) -> dict:
    """Rates of serving requests in elapsed_s (all at once or one by one alike); given the CPU
    seconds the system spent on them (every process of it), the generated tokens per CPU second
    too: on a shared machine wall time measures the share of the cores a system got as much as
    the system."""
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    output = sum(r.max_tokens for r in requests)
    rates = {"elapsed_s": round(elapsed_s, 3), "requests_per_s": round(len(requests) / elapsed_s, 3),
             "output_tokens_per_s": round(output / elapsed_s, 2),
             "total_tokens_per_s": round((prompt + output) / elapsed_s, 2)}
    if cpu_s is not None:
        rates.update(cpu_s=round(cpu_s, 3), output_tokens_per_cpu_s=round(output / max(cpu_s, 1e-9), 2))
    return rates


def stream_one(engine: LLMEngine, request: BenchRequest, request_id: str) -> StreamTiming:
    """Serve one request alone, timing its first token and the rest."""
    params = SamplingParams(temperature=0, max_tokens=request.max_tokens, ignore_eos=True)
    started = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": request.prompt_token_ids}, params)
    first = first_cpu = None
    while engine.has_unfinished_requests():
        engine.step()
        if first is None:
            first, first_cpu = time.perf_counter(), time.process_time()
    ended, ended_cpu = time.perf_counter(), time.process_time()
    return StreamTiming(first - started, ended - first, request.max_tokens, ended_cpu - first_cpu)


def run_sequential(engine: LLMEngine, requests: list[BenchRequest]) -> dict:
    elapsed = sum(run_workload(engine, [r], tag=f"seq-{i}").elapsed_s for i, r in enumerate(requests))
    return summarize_run(elapsed, requests)
