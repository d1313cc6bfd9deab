"""The llama.cpp baseline: llama-cpp-python serving the same GGUF, in a subprocess of its own
interpreter (its own venv, never a dependency of this project: ../shared/tools/llama-cpp/setup.sh
builds one). bench/llama_cpp_worker.py runs there and speaks JSON lines; it uses as many threads
as torch does here. One request at a time (single stream, sequential) through its Python API, and
every request at once (batched) as llama-server's parallel slots serve them: continuous batching
through llama.cpp's C API, one sequence per request."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

from pagedllm.bench.scenarios import StreamTiming
from pagedllm.bench.workload import BenchRequest

SYSTEM = "llama.cpp"
SCENARIOS = ("batched", "single_stream", "sequential")
_WORKER = Path(__file__).with_name("llama_cpp_worker.py")


def add_args(parser) -> None:
    parser.add_argument("--llama-cpp-python", default=None, metavar="PATH",
                        help="the python interpreter of a venv with llama-cpp-python, for "
                             "--baseline llama.cpp")
    parser.add_argument("--llama-cpp-prompt-lookup", type=int, default=None, metavar="K",
                        help="llama.cpp speculates with prompt lookup, K tokens proposed a step "
                             "(llama-cpp-python's LlamaPromptLookupDecoding; its default is 10): the "
                             "rival of --speculative-config's ngram method")


class Session:
    def __init__(self, python: str, model: Path, threads: int, n_ctx: int, prompt_lookup: int | None = None):
        self.process = subprocess.Popen([python, str(_WORKER)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self.info = self._ask({"model": str(model), "threads": threads, "n_ctx": n_ctx,
                               "prompt_lookup": prompt_lookup})
        self.info.update(threads=threads, model=str(model), prompt_lookup=prompt_lookup)
        self.token_ids: list[list[int]] = []  # what the last batched run generated, request by request
        self.cpu_s: float | None = None  # the last batched run's CPU seconds

    def _ask(self, message: dict) -> dict:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()
        reply = self.process.stdout.readline()
        if not reply:
            raise RuntimeError(f"the llama.cpp worker exited (code {self.process.wait()}); "
                               "its error is above")
        return json.loads(reply)

    def stream(self, request: BenchRequest) -> StreamTiming:
        reply = self._ask({"prompt_token_ids": request.prompt_token_ids,
                           "max_tokens": request.max_tokens})
        return StreamTiming(reply["ttft_s"], reply["decode_s"], len(reply["token_ids"]),
                            reply["decode_cpu_s"])

    def batched(self, requests: list[BenchRequest]) -> float:
        reply = self._ask({"requests": [{"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens}
                                        for r in requests]})
        self.token_ids, self.cpu_s = reply["token_ids"], reply["cpu_s"]
        return reply["elapsed_s"]

    def close(self) -> dict:
        self.process.stdin.close()
        final = json.loads(self.process.stdout.readline() or "{}")
        self.process.wait()
        return {k: v for k, v in final.items() if k != "done"}


def start(engine, args, requests: list[BenchRequest]) -> Session:
    if not args.llama_cpp_python:
        raise ValueError("--baseline llama.cpp needs --llama-cpp-python PATH (a venv's python with "
                         "llama-cpp-python; ../shared/tools/llama-cpp/setup.sh builds one)")
    if Path(engine.model_path).suffix != ".gguf":
        raise ValueError(f"--baseline llama.cpp runs GGUF files; {engine.model_path} is not one")
    lookup = args.llama_cpp_prompt_lookup
    if lookup is not None and lookup < 1:
        raise ValueError(f"--llama-cpp-prompt-lookup takes a number of tokens >= 1; got {lookup}")
    n_ctx = max(len(r.prompt_token_ids) + r.max_tokens for r in requests) + 8 + (lookup or 0)
    return Session(args.llama_cpp_python, engine.model_path, torch.get_num_threads(), n_ctx, lookup)
