"""The llama.cpp baseline: llama-cpp-python serving the same GGUF, in a subprocess of its own
interpreter (its own venv, never a dependency of this project: ../shared/tools/llama-cpp/setup.sh
builds one). bench/llama_cpp_worker.py runs there and speaks JSON lines; it uses as many threads
as torch does here. One request at a time (single stream, sequential) through its Python API, and
every request at once (batched) as llama-server's parallel slots serve them: continuous batching
through llama.cpp's C API, one sequence per request."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedllm.bench.scenarios import StreamTiming
from pagedllm.bench.worker_session import WorkerSession
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


class Session(WorkerSession):
    system = "llama.cpp"

    def __init__(self, python: str, model: Path, threads: int, n_ctx: int, prompt_lookup: int | None = None):
        super().__init__(python, _WORKER, {"model": str(model), "threads": threads, "n_ctx": n_ctx,
                                           "prompt_lookup": prompt_lookup})
        self.info.update(threads=threads, model=str(model), prompt_lookup=prompt_lookup)

    def stream(self, request: BenchRequest) -> StreamTiming:
        reply = self._ask({"prompt_token_ids": request.prompt_token_ids,
                           "max_tokens": request.max_tokens})
        return StreamTiming(reply["ttft_s"], reply["decode_s"], len(reply["token_ids"]),
                            reply["decode_cpu_s"])


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
