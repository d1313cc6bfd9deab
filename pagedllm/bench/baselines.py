"""Rival systems that `bench throughput --baseline NAME` runs on the same requests as pagedllm, in
the same process run, so both see the same machine.

A baseline is a module with:
- SYSTEM: the name its rows carry; SCENARIOS: which of bench/scenarios.py's it takes part in
  ("batched" needs session.batched, "single_stream" and "sequential" need session.stream);
- add_args(parser): its own flags (every baseline's flags are always accepted);
- start(engine, args, requests) -> a session: it loads the rival on engine's model (requests: all
  it will be given, to size its context) with .info (facts for the JSON: version, load time,
  RSS), .stream(request) -> StreamTiming, .batched(requests) -> elapsed seconds (and, where the
  rival can count them, .cpu_s: the CPU seconds of its last batched run), and .close() -> facts
  known at the end (peak RSS).
Adding a rival is one module and one line in BASELINES.
"""

from __future__ import annotations

import importlib
from types import ModuleType

BASELINES = {
    "hf": "pagedllm.bench.hf_baseline",
    "llama.cpp": "pagedllm.bench.llama_cpp_baseline",
    "vllm": "pagedllm.bench.vllm_baseline",
}


def load(name: str) -> ModuleType:
    return importlib.import_module(BASELINES[name])


def add_args(parser) -> None:
    parser.add_argument("--baseline", choices=["none", *BASELINES], default="none",
                        help="also run this system on the same requests: hf (transformers, static "
                             "batches), llama.cpp (llama-cpp-python, one request at a time), vllm "
                             "(vLLM's offline LLM.generate, every request at once)")
    for name in BASELINES:
        load(name).add_args(parser)
