"""Helpers every bench shares: building an engine, driving it over a workload, writing JSON."""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from dataclasses import dataclass, field

from pagedllm.bench.workload import BenchRequest
from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def peak_rss_bytes() -> int:
    """This process's peak resident memory (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class StepRecord:
    t_s: float
    allocated_slots: int
    used_slots: int
    running: int
    waiting: int


@dataclass
class RunResult:
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    num_preemptions: int
    steps: list[StepRecord] = field(default_factory=list)

    def rates(self) -> dict:
        e = max(self.elapsed_s, 1e-9)
        return {"elapsed_s": round(self.elapsed_s, 3),
                "requests_per_s": round(self.num_requests / e, 3),
                "output_tokens_per_s": round(self.output_tokens / e, 2),
                "total_tokens_per_s": round((self.prompt_tokens + self.output_tokens) / e, 2)}


def run_workload(engine: LLMEngine, requests: list[BenchRequest], record_steps: bool = False,
                 tag: str = "bench") -> RunResult:
    """Add every request at once (ignore_eos, greedy) and step until all finish."""
    for i, r in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": r.prompt_token_ids}, params)
    steps: list[StepRecord] = []
    output_tokens = 0
    preemptions_before = engine.scheduler.num_preemptions
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if record_steps:
            s = engine.scheduler.memory_stats()
            steps.append(StepRecord(time.perf_counter() - started, s["allocated_slots"],
                                    s["used_slots"], s["num_running"], s["num_waiting"]))
        output_tokens += sum(len(o.outputs[0].token_ids) for o in outputs if o.finished)
    elapsed = time.perf_counter() - started
    return RunResult(elapsed, len(requests), sum(len(r.prompt_token_ids) for r in requests),
                     output_tokens, engine.scheduler.num_preemptions - preemptions_before, steps)


def engine_config(args, **overrides) -> EngineConfig:
    from pagedllm.cli import engine_config_from_args

    config = engine_config_from_args(args)
    for key, value in overrides.items():
        setattr(config, key, value)
    config.__post_init__()
    return config


def write_json(path: str | None, payload: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
    logger.info("wrote %s", path)


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print(f"\n{title}")
    print("  ".join(str(h).ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
