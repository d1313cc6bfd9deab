"""Helpers every bench shares: building an engine, driving it over a workload, writing JSON."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.bench.workload import BenchRequest
from pagedllm.config import EngineConfig, engine_config_from_args
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.structured.spec import GrammarSpec

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
    token_ids: list[list[int]] = field(default_factory=list)  # each request's output, in order
    cpu_s: float | None = None  # this process's CPU time over the run (every thread)

    def rates(self) -> dict:
        e = max(self.elapsed_s, 1e-9)
        rates = {"elapsed_s": round(self.elapsed_s, 3),
                 "requests_per_s": round(self.num_requests / e, 3),
                 "output_tokens_per_s": round(self.output_tokens / e, 2),
                 "total_tokens_per_s": round((self.prompt_tokens + self.output_tokens) / e, 2)}
        if self.cpu_s is not None:
            rates.update(cpu_s=round(self.cpu_s, 3),
                         output_tokens_per_cpu_s=round(self.output_tokens / max(self.cpu_s, 1e-9), 2))
        return rates


def run_workload(engine: LLMEngine, requests: list[BenchRequest], record_steps: bool = False,
                 tag: str = "bench", on_step: Callable[[float], None] | None = None,
                 structured_outputs: GrammarSpec | None = None, temperature: float = 0.0,
                 loras: list | None = None) -> RunResult:
    """Add every request at once (ignore_eos; greedy unless a temperature is given; constrained
    to structured_outputs if given; request i with LoRA adapter loras[i % len(loras)] if given)
    and step until all finish. on_step, if given, is called after each step with the time since
    the start (a step record's t_s)."""
    for i, r in enumerate(requests):
        params = SamplingParams(temperature=temperature, max_tokens=r.max_tokens, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY,
                                structured_outputs=structured_outputs)
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": r.prompt_token_ids}, params,
                           lora_request=loras[i % len(loras)] if loras else None)
    steps: list[StepRecord] = []
    finished: dict[str, list[int]] = {}
    preemptions_before = engine.stats().num_preemptions
    started, started_cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        t_s = time.perf_counter() - started
        if record_steps:
            s = engine.stats()
            steps.append(StepRecord(t_s, s.kv.allocated_slots, s.kv.used_slots, s.num_running,
                                    s.num_waiting))
        if on_step is not None:
            on_step(t_s)
        finished.update((o.request_id, o.outputs[0].token_ids) for o in outputs if o.finished)
    elapsed, cpu_s = time.perf_counter() - started, time.process_time() - started_cpu
    token_ids = [finished[f"{tag}-{i}"] for i in range(len(requests))]
    return RunResult(elapsed, len(requests), sum(len(r.prompt_token_ids) for r in requests),
                     sum(map(len, token_ids)), engine.stats().num_preemptions - preemptions_before,
                     steps, token_ids, cpu_s)


def serve_one(engine: LLMEngine) -> None:
    """Serve one tiny request: the first calls' one-off costs (a kernel build, first allocations)
    are paid here, not inside a measurement."""
    engine.add_request("warmup", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()


def forget_cached_prefixes(engine: LLMEngine) -> None:
    """Drop every prefix the engine's KV cache holds, so requests it has served before are
    computed again: a timed rerun of a workload must not skip its prompts (a rival, or a twin
    engine beside it, finds nothing cached)."""
    if not engine.engine_core.kv_manager.reset_prefix_cache():
        raise RuntimeError("the prefix cache cannot be reset while requests hold blocks")


def add_threads_arg(parser) -> None:
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's own; 1 is steadiest on a "
                             "shared machine)")


def apply_threads(args) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)


def engine_config(args, **overrides) -> EngineConfig:
    """The engine flags' config with a bench's own settings on top (validated as any)."""
    return engine_config_from_args(args, **overrides)


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


@contextlib.contextmanager
def shared_model_loads():
    """Engines made inside load each (path, dtype, device, quantization) once: a bench that builds
    one engine per setting (layout, block size) reuses the weights. The model holds no per-engine
    state; the KV cache belongs to each engine's runner. Tensor-parallel engines load their own
    (their workers belong to one engine)."""
    import pagedllm.engine.core_loader as engine_core_module

    original = engine_core_module.load_engine_model
    loaded: dict = {}

    def load_once(config, device):
        if config.tensor_parallel_size > 1:
            return original(config, device)
        key = (str(config.model), str(config.dtype), str(device), config.quantization,
               config.quantization_group_size)
        if key not in loaded:
            loaded[key] = original(config, device)
        return loaded[key]

    engine_core_module.load_engine_model = load_once
    try:
        yield
    finally:
        engine_core_module.load_engine_model = original


@dataclass
class CallTimer:
    """Wall time and calls spent in one function, summed."""

    seconds: float = 0.0
    calls: int = 0
    _depth: int = 0  # a wrapped call reached again inside itself (a dispatcher) counts once

    def wrap(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls += 1
                self._depth -= 1
        return timed


@contextlib.contextmanager
def timed_functions(*functions):
    """Time every call of the given functions, wherever they are called from: each module that
    imported one by name (`from pagedllm.kernels.attention import paged_attention`) gets a timing wrapper
    under that name until the block ends. Yields one CallTimer per function, in order."""
    timers = [CallTimer() for _ in functions]
    patched = []
    for module in list(sys.modules.values()):
        for name, value in list(getattr(module, "__dict__", {}).items()):
            for fn, timer in zip(functions, timers):
                if value is fn and not name.startswith("__"):
                    patched.append((module, name, value))
                    setattr(module, name, timer.wrap(fn))
    try:
        yield timers
    finally:
        for module, name, value in patched:
            setattr(module, name, value)


def device_name(device) -> str:
    """"cpu", or the GPU's name (what a tokens/s figure on a GPU means depends on it)."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def peak_gpu_memory(device) -> dict:
    import torch

    if device.type != "cuda":
        return {}
    return {"peak_gpu_mib": round(torch.cuda.max_memory_allocated(device) / 2**20, 1)}
