"""Typed engine settings and size parsing. No torch here."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a string like "512MiB", "2GiB", "1.5GB"."""
    if isinstance(value, bool):
        raise ValueError(f"memory size must be bytes or a string like '2GiB'; got {value!r}")
    if isinstance(value, (int, float)):
        size = int(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS:
            raise ValueError(f"memory size must be bytes or a string like '512MiB' or '2GiB'; got {value!r}")
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"memory size must be positive; got {value!r}")
    return size


VALID_BLOCK_SIZES = tuple(2**i for i in range(8))  # 1 .. 128
KV_LAYOUTS = ("paged", "contiguous")
CONTIGUOUS_RESERVES = ("max", "request")
# What the KV cache stores (vLLM's names): "auto" is the model's dtype; the others compress it
# (pagedllm.kernels.attention.kv_quant). "fp8" is vLLM's alias for fp8_e4m3.
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}


def canonical_kv_cache_dtype(name: str) -> str:
    """The kv_cache_dtype a name means ("fp8" -> "fp8_e4m3"); ValueError naming the valid ones."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}")
    return KV_CACHE_DTYPE_ALIASES.get(name, name)
QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")
# How the ranks past 0 of a tensor-parallel engine start (vLLM's names): "mp", the engine spawns
# them on this machine; "external_launcher", they are started elsewhere (torchrun, or by hand with
# MASTER_ADDR etc.: docs/distributed.md).
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "external_launcher")


def check_device_name(device: str) -> None:
    """auto, cpu, cuda or cuda:N (whether CUDA is there is checked where torch is)."""
    if not isinstance(device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got {device!r}")


@dataclass
class SchedulerConfig:
    """The scheduler's limits, filled in from EngineConfig (which declares the defaults)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")


SERVE_MAX_NUM_BATCHED_TOKENS = 2048


def default_block_size(device_type: str) -> int:
    """Tokens per KV block where none is asked for. On the CPU 64: a decode reads each request's
    blocks from DRAM, and longer runs of them read faster (the bench workload 4% faster than with
    16, in lockstep; 128 gained no more and wastes twice the tail; vLLM's CPU default is 128). On a
    GPU 16, as vLLM's."""
    return 64 if device_type == "cpu" else 16


@dataclass
class EngineConfig:
    """Everything `LLM(...)` and `pagedllm serve` accept, named like vLLM's options. The one
    place their defaults are declared: the CLI and the offline API read them from here."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    dtype: str = "auto"
    block_size: int | None = None  # tokens per KV block; None: default_block_size(the device)
    kv_cache_memory: int | str | None = None  # bytes or "512MiB"; None: a share of free RAM
    num_kv_blocks: int | None = None  # the budget in blocks instead of bytes (overrides memory)
    # None: the model's own limit (max_position_embeddings), cut to the longest request the KV
    # budget holds where that is less (pagedllm.core.kv.plan)
    max_model_len: int | None = None
    max_num_seqs: int = 256
    # Tokens per step, as vLLM's CPU defaults: 4096 offline (longer prefill chunks, fewer steps:
    # the bench workload 1.5% faster than with 2048); `pagedllm serve` keeps 2048
    # (SERVE_MAX_NUM_BATCHED_TOKENS): a shorter step delays the streams it runs beside less.
    max_num_batched_tokens: int = 4096
    kv_layout: str = "paged"  # or "contiguous"
    # contiguous layout only: reserve max_model_len ("max") or prompt + max_tokens ("request")
    contiguous_reserve: str = "max"
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # or int8, fp8 (= fp8_e4m3), fp8_e4m3, fp8_e5m2
    seed: int = 0
    device: str = "auto"  # "auto": CUDA where available, else the CPU
    # auto: a GGUF's quantized weights stay quantized, float checkpoints stay float; none:
    # dequantize at load; int8 / int4: quantize a Hugging Face folder's matmul weights at load.
    quantization: str = "auto"
    quantization_group_size: int = 32  # inputs per scale, for int8 / int4
    # Sampling defaults for unset request fields: "auto" (the model's generation_config.json),
    # "vllm" or "none" (SamplingParams' own), or a folder with a generation_config.json.
    generation_config: str = "auto"
    # Tensor parallelism (pagedllm.distributed): the model split over this many processes.
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"  # or "external_launcher"
    # How long a rank waits for the others in one collective before the engine fails (a worker
    # that hangs); a dead worker fails the step at once.
    distributed_timeout_s: float = 120.0
    # Greedy outputs that do not depend on the batch, chunking or preemption, bf16 included, at
    # some prefill speed (pagedllm.model.batch_invariant says what it covers; CPU only).
    batch_invariant: bool = False
    # No CUDA graphs: every decode step launches its kernels from Python (pagedllm.worker.cuda_graphs
    # says what the graphs cover). vLLM's flag.
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.block_size is not None and self.block_size not in VALID_BLOCK_SIZES:
            raise ValueError(f"block_size must be a power of two from 1 to 128; got {self.block_size}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be 'paged' or 'contiguous'; got {self.kv_layout!r}")
        if self.contiguous_reserve not in CONTIGUOUS_RESERVES:
            raise ValueError(
                f"contiguous_reserve must be 'max' or 'request'; got {self.contiguous_reserve!r}")
        canonical_kv_cache_dtype(self.kv_cache_dtype)
        # The scheduler's own checks, so every entry point rejects the same values.
        SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len or 1)
        if self.kv_cache_memory is not None:
            parse_size(self.kv_cache_memory)
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int)
                                                or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be a positive integer; got {self.num_kv_blocks!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer; got {self.seed!r}")
        check_device_name(self.device)
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}; "
                             f"got {self.quantization!r}")
        group = self.quantization_group_size
        if not isinstance(group, int) or group < 16 or group % 16 or (
                self.quantization == "int4" and group != 16 and group % 32):
            raise ValueError(f"quantization_group_size must be a multiple of 16 (int8) or 16 or a "
                             f"multiple of 32 (int4); got {group!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer; "
                             f"got {self.tensor_parallel_size!r}")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}; "
                             f"got {self.distributed_executor_backend!r}")
        timeout = self.distributed_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"distributed_timeout_s must be a positive number of seconds; "
                             f"got {timeout!r}")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be true or false; got {self.batch_invariant!r}")
        if self.batch_invariant and self.device.startswith("cuda"):
            raise ValueError("batch_invariant runs on the CPU only: the GPU kernels choose their "
                             f"own summation orders (device {self.device!r}); use --device cpu")
        if self.batch_invariant and self.tensor_parallel_size > 1:
            raise ValueError("batch_invariant runs on one process: tensor parallelism sums partial "
                             "results across ranks in an order it does not fix; use "
                             "tensor_parallel_size 1")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be true or false; got {self.enforce_eager!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError("generation_config must be 'auto', 'vllm', 'none' or a folder holding "
                             f"a generation_config.json; got {self.generation_config!r}")


def engine_defaults() -> dict:
    """EngineConfig's default for each option, by name (for the CLI's flags)."""
    return {f.name: f.default for f in fields(EngineConfig)}


# -- the engine's command-line flags -------------------------------------------------------------
def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags, named like vLLM's; their defaults are EngineConfig's."""
    default = engine_defaults()
    parser.add_argument("--model", default=default["model"],
                        help="HF folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default=default["dtype"], help="auto, float32 or bfloat16")
    parser.add_argument("--block-size", type=int, default=default["block_size"],
                        help="tokens per KV block (default: 64 on the CPU, 16 on a GPU)")
    parser.add_argument("--kv-cache-memory", default=default["kv_cache_memory"],
                        help="bytes or e.g. 512MiB, 2GiB (default: a share of free RAM)")
    parser.add_argument("--max-model-len", type=int, default=default["max_model_len"],
                        help="default: the model's limit, or the longest request the KV cache "
                             "memory holds where that is less")
    parser.add_argument("--max-num-seqs", type=int, default=default["max_num_seqs"])
    parser.add_argument("--max-num-batched-tokens", type=int, default=default["max_num_batched_tokens"])
    parser.add_argument("--kv-layout", choices=list(KV_LAYOUTS), default=default["kv_layout"])
    parser.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=default["kv_cache_dtype"],
                        help="what the KV cache stores: auto (the model's dtype), int8, fp8 "
                             "(= fp8_e4m3) or fp8_e5m2")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=default["enable_prefix_caching"])
    parser.add_argument("--seed", type=int, default=default["seed"])
    parser.add_argument("--device", default=default["device"],
                        help="auto (CUDA where available, else the CPU), cpu, cuda or cuda:N")
    parser.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default=default["quantization"],
                        help="auto: a GGUF's quantized weights stay quantized (default); none: "
                             "dequantize at load; int8/int4: quantize a HF folder's weights at load")
    parser.add_argument("--quantization-group-size", type=int, default=default["quantization_group_size"],
                        help="inputs per scale for --quantization int8/int4")
    parser.add_argument("--generation-config", default=default["generation_config"],
                        help="sampling defaults for fields a request leaves unset: auto (the model's "
                             "generation_config.json), vllm or none (the library's), or a folder")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=default["tensor_parallel_size"],
                        help="split the model over this many processes (docs/distributed.md)")
    parser.add_argument("--distributed-executor-backend", choices=DISTRIBUTED_EXECUTOR_BACKENDS,
                        default=default["distributed_executor_backend"],
                        help="mp: the engine starts its tensor-parallel workers on this machine; "
                             "external_launcher: they are started by torchrun or by hand")
    parser.add_argument("--distributed-timeout", type=float, dest="distributed_timeout_s",
                        default=default["distributed_timeout_s"],
                        help="seconds a rank waits for the others in one collective before the "
                             "engine fails")
    parser.add_argument("--batch-invariant", action="store_true", default=default["batch_invariant"],
                        help="greedy outputs that do not depend on the batch, chunking or "
                             "preemption (bf16 too; CPU only; slower prefill)")
    parser.add_argument("--enforce-eager", action="store_true", default=default["enforce_eager"],
                        help="no CUDA graphs: run every decode step eagerly (GPU only; slower)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    memory = args.kv_cache_memory
    if memory is not None and str(memory).isdigit():
        memory = int(memory)
    return EngineConfig(model=args.model, dtype=args.dtype, block_size=args.block_size,
                        kv_cache_memory=memory, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        kv_layout=args.kv_layout, enable_prefix_caching=args.enable_prefix_caching,
                        kv_cache_dtype=args.kv_cache_dtype, seed=args.seed, device=args.device,
                        quantization=args.quantization,
                        quantization_group_size=args.quantization_group_size,
                        generation_config=args.generation_config,
                        tensor_parallel_size=args.tensor_parallel_size,
                        distributed_executor_backend=args.distributed_executor_backend,
                        distributed_timeout_s=args.distributed_timeout_s,
                        batch_invariant=args.batch_invariant, enforce_eager=args.enforce_eager)
