"""Typed, validated settings, and the command-line flags derived from them. No torch here.

A setting is declared once, as a dataclass field made by `setting(...)`: its type (the
annotation), default, help, choices (from the tables below) and, where it is not the field's name,
its flag. `add_config_args` turns every field of a settings class into one flag and
`config_from_args` maps the parsed flags back, so a field added later gets its flag with no more
code. EngineConfig is the engine's (`LLM(...)`, every command's engine flags); the server's
ServerConfig (pagedllm/server/config.py) is built the same way. The process-wide environment
variables are pagedllm/envs.py's.

Validation happens in one place, the dataclass's __post_init__: each field's type and choices
(from the declaration), its own check where it has one, then the rules that tie fields together.
Code never changes a config it is given: a changed copy is `dataclasses.replace(config, ...)`,
which validates again.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields

from pagedllm.sampling_bounds import INT32_MAX, MAX_LOGPROBS, WHOLE_VOCABULARY

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


# -- the tables a setting's choices come from ----------------------------------------------------
# The model's dtype, by vLLM's and torch's names. "auto": bfloat16 where the device computes in it
# natively or the CPU multiplies a model's quantized weights with int8 activations, else float32 on
# a CPU and float16 on a GPU (pagedllm.model.loader.resolve_dtype and resolve_model_dtype).
DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16",
                 "fp16": "float16"}
VALID_BLOCK_SIZES = tuple(2**i for i in range(8))  # 1 .. 128
KV_LAYOUTS = ("paged", "contiguous")
# Which waiting request runs first: arrival order, or a request's priority (lower first; ties by
# arrival); pagedllm.core.priority says the rule.
SCHEDULING_POLICIES = ("fcfs", "priority")
CONTIGUOUS_RESERVES = ("max", "request")
# What the KV cache stores (vLLM's names): "auto" is the model's dtype; the others compress it
# (pagedllm.kernels.attention.kv_quant). "fp8" is vLLM's alias for fp8_e4m3.
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")
# How the ranks past 0 of a tensor-parallel engine start (vLLM's names): "mp", the engine spawns
# them on this machine; "external_launcher", they are started elsewhere (torchrun, or by hand with
# MASTER_ADDR etc.: docs/distributed.md).
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "external_launcher")
# What an engine's requests get back: tokens (generate) or vectors from the final hidden states
# (pooling: pagedllm.pooling_params). vLLM's --task embed|score spells the second.
RUNNERS = ("generate", "pooling")
POOLING_TASK_NAMES = ("embed", "score", "reward")
# How an embedding pools a prompt's final hidden states (pagedllm.worker.pooler).
POOLING_TYPES = ("last", "mean", "cls")


def canonical_dtype(name) -> str:
    """The dtype a name means, one of DTYPES ("half" -> "float16"); a torch.dtype is taken by its
    name. ValueError naming the valid ones."""
    text = str(name).removeprefix("torch.")
    text = DTYPE_ALIASES.get(text, text)
    if text not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or {', '.join(DTYPE_ALIASES)}); "
                         f"got {name!r}")
    return text


def canonical_kv_cache_dtype(name: str) -> str:
    """The kv_cache_dtype a name means ("fp8" -> "fp8_e4m3"); ValueError naming the valid ones."""
    if name not in KV_CACHE_DTYPES:
        raise _choice_error("kv_cache_dtype", name, KV_CACHE_DTYPES)
    return KV_CACHE_DTYPE_ALIASES.get(name, name)


def check_device_name(device: str) -> None:
    """auto, cpu, cuda or cuda:N (whether CUDA is there is checked where torch is)."""
    if not isinstance(device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got {device!r}")


# -- declaring a setting --------------------------------------------------------------------------
def setting(default, help: str, *, choices: tuple | None = None, flag: str | None = None,
            aliases: tuple[str, ...] = (), parse: Callable[[str], object] | None = None,
            check: Callable[[str, object], None] | None = None, group: str | None = None,
            secret: bool = False, nargs: str | None = None):
    """A dataclass field that declares its flag too.

    help: what it does (and what None means, where None is its default); choices: the values it
    takes; flag: its flag where that is not `--the-field-name` (vLLM's spelling wins), aliases:
    more spellings (`-tp`); parse: the flag's text -> value, for types other than int, float, str
    (bool fields get `--x/--no-x`); check(name, value): a rule of its own, raising ValueError,
    run instead of the choices or type check; group: the --help section it is listed in;
    secret: left out of the config's repr (an API key must not reach a log line); nargs: "+" or
    "*" for a tuple field whose flag takes several values (each one through parse)."""
    return field(default=default, repr=not secret, metadata={
        "help": help, "choices": choices, "flag": flag, "aliases": aliases, "parse": parse,
        "check": check, "group": group, "nargs": nargs})


def _choice_error(name: str, value, choices: tuple) -> ValueError:
    return ValueError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")


def check_fields(config) -> None:
    """Each field of a settings dataclass against its declaration: its own check where it has
    one, else its choices where it has them, else its type. A None where None is the default
    always passes."""
    hints = _type_hints(type(config))
    for f in fields(config):
        value = getattr(config, f.name)
        if value is None and f.default is None:
            continue
        check = f.metadata.get("check")
        if check is not None:
            check(f.name, value)
            continue
        choices = f.metadata.get("choices")
        if choices is not None:  # the valid values say more than their type (and True == 1)
            if not (_has_type(value, hints[f.name]) and value in choices):
                raise _choice_error(f.name, value, choices)
        elif not _has_type(value, hints[f.name]):
            raise ValueError(f"{f.name} must be {_type_words(hints[f.name])}; got {value!r}")


@functools.cache
def _type_hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _type_args(hint) -> tuple:
    """The types a hint allows: (int, NoneType) for `int | None`; (hint,) for a plain one."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def _has_type(value, hint) -> bool:
    return any(_is_a(value, kind) for kind in _type_args(hint))


def _is_a(value, kind) -> bool:
    """isinstance as a setting means it: True is no integer, an integer is a float, a
    tuple[str, ...] holds strings."""
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float))
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]
        return isinstance(value, tuple) and all(_is_a(v, item) for v in value)
    return isinstance(value, kind) if isinstance(kind, type) else True


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
               type(None): "None"}


def _type_words(hint) -> str:
    return " or ".join(_TYPE_WORDS.get(t, str(t)) for t in _type_args(hint))


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")


def _max_logprobs(name: str, value) -> None:
    """A count of alternatives per token, or -1: the whole vocabulary."""
    if isinstance(value, bool) or not isinstance(value, int) or not WHOLE_VOCABULARY <= value <= INT32_MAX:
        raise ValueError(f"{name} must be a non-negative integer or -1 (the whole vocabulary); "
                         f"got {value!r}")


def check_positive_seconds(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds; got {value!r}")


def _memory_size(name: str, value) -> None:
    parse_size(value)


def _model_path(name: str, value) -> None:
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{name} must be a path (a string or os.PathLike) or None; got {value!r}")


def _dtype(name: str, value) -> None:
    canonical_dtype(value)


def _device(name: str, value) -> None:
    check_device_name(value)


def _generation_config(name: str, value) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError("generation_config must be 'auto', 'vllm', 'none' or a folder holding "
                         f"a generation_config.json; got {value!r}")


def _speculative_config(name: str, value) -> None:
    """A dict or its JSON text that pagedllm.spec_decode.config accepts (it imports no torch)."""
    from pagedllm.spec_decode.config import SpeculativeConfig

    SpeculativeConfig.parse(value)


def _comma_list(text: str) -> tuple[str, ...]:
    """Comma-separated strings (spaces kept: a label token may be one)."""
    return tuple(item for item in text.split(",") if item)


def _lora_modules(name: str, value) -> None:
    from pagedllm.lora.request import parse_lora_modules  # torch-free

    if not isinstance(value, tuple):
        raise ValueError(f"{name} must be a tuple of 'name=path' strings; got {value!r}")
    parse_lora_modules(value)


def _size_flag(text: str) -> int | str:
    """--kv-cache-memory's text: bytes as an int, a size with a unit as written ("2GiB")."""
    parse_size(text)
    return int(text) if text.strip().isdigit() else text


@dataclass
class SchedulerConfig:
    """The scheduler's limits, filled in from EngineConfig (which declares the defaults)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    scheduling_policy: str = "fcfs"
    step_share_tokens: int | None = None  # None: measured (pagedllm.core.step_cost); 0: off

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        share = self.step_share_tokens
        if share is not None and (not isinstance(share, int) or isinstance(share, bool) or share < 0):
            raise ValueError(f"step_share_tokens must be a non-negative integer; got {share!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise _choice_error("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)


SERVE_MAX_NUM_BATCHED_TOKENS = 2048


def default_block_size(device_type: str) -> int:
    """Tokens per KV block where none is asked for: 16 on every device. A request's last block is
    half empty on average, so waste grows with the block (the memory bench's workload: 2.04% of the
    slots at 16, 8.16% at 64; short sequences far more), while bigger pages no longer buy speed
    (level on AVX2, 4% with the AMX kernels): docs/benchmarks.md, "Block size". device_type is kept
    for a device whose kernels would want another size."""
    return 16


def _cpu_isa(name: str, value) -> None:
    """One of CPU_ISA_CHOICES, at most the CPU's best tier (pagedllm.kernels.tiers)."""
    from pagedllm.kernels import tiers  # torch-free; imported where the field is checked

    if not isinstance(value, str):
        raise _choice_error(name, value, tiers.CPU_ISA_CHOICES)
    tiers.resolve(value)


@dataclass
class EngineConfig:
    """Everything `LLM(...)` and the engine flags of every command accept, named like vLLM's
    options: the one place their defaults, help and choices are declared."""

    # A str as declared (the core process decodes the config by its annotations); a Path is taken
    # too, offline.
    model: str | None = setting(
        None, "a Hugging Face model folder or a .gguf file (default: the embedded "
        "SmolLM2-135M-Instruct)", check=_model_path)
    dtype: str = setting(
        "auto", "the model's dtype: auto is bfloat16 where the device computes in it natively or "
        "the CPU multiplies the model's quantized weights with int8 activations, else float32 on a "
        "CPU and float16 on a GPU", choices=(*DTYPES, *DTYPE_ALIASES), check=_dtype)
    block_size: int | None = setting(
        None, "tokens per KV block (default: 16)", choices=VALID_BLOCK_SIZES)
    kv_cache_memory: int | str | None = setting(
        None, "the KV cache's budget: bytes, or e.g. 512MiB, 2GiB (default: a share of the free "
        "memory)", parse=_size_flag, check=_memory_size)
    num_kv_blocks: int | None = setting(
        None, "the KV cache's budget in blocks instead of bytes (overrides --kv-cache-memory)",
        check=check_positive_int)
    max_model_len: int | None = setting(
        None, "the longest request, prompt and output (default: the model's limit, cut to the "
        "longest request the KV cache holds where that is less; the start-up line says which)")
    max_num_seqs: int = setting(256, "requests in one step at most")
    # 4096 tokens per step, as vLLM's CPU default: longer prefill chunks, fewer steps (the bench
    # workload 1.5% faster than with 2048). `pagedllm serve` keeps 2048
    # (SERVE_MAX_NUM_BATCHED_TOKENS): a shorter step delays the streams it runs beside less.
    max_num_batched_tokens: int = setting(
        4096, "tokens in one step at most, prompt chunks and decodes together")
    scheduling_policy: str = setting(
        "fcfs", "which waiting request runs first: fcfs (arrival order) or priority (a request's "
        "priority, lower first, ties by arrival; a better priority preempts a worse one for blocks)",
        choices=SCHEDULING_POLICIES)
    step_share_tokens: int | None = setting(
        None, "while other requests share a step, a request of several sequences (prompts x n) "
        "takes at most their tokens plus this many, so their time between tokens grows by a bounded "
        "share (default: measured as the engine runs, half the tokens a step computes in the time "
        "it reads its weights: about 1.5x at most; 0: no such cap)")
    # pagedllm.sampling_bounds.logprobs_cap: every alternative is an entry per token in an output.
    max_logprobs: int = setting(
        MAX_LOGPROBS, "the most log-probability alternatives per token a request may ask for "
        "(logprobs, prompt_logprobs, top_logprobs); -1: the whole vocabulary", check=_max_logprobs)
    kv_layout: str = setting(
        "paged", "paged: blocks taken as tokens come; contiguous: the traditional reservation "
        "per request, for side-by-side measurement", choices=KV_LAYOUTS)
    contiguous_reserve: str = setting(
        "max", "with --kv-layout contiguous, what a request reserves: max_model_len (max) or "
        "its prompt and max_tokens (request)", choices=CONTIGUOUS_RESERVES)
    enable_prefix_caching: bool = setting(
        True, "reuse the KV blocks of prompt prefixes computed before")
    kv_cache_dtype: str = setting(
        "auto", "what the KV cache stores: auto (the model's dtype), or compressed: int8, fp8 "
        "(= fp8_e4m3), fp8_e5m2", choices=KV_CACHE_DTYPES)
    seed: int = setting(0, "the engine's random seed (a request's own seed: SamplingParams.seed)")
    device: str = setting(
        "auto", "auto (CUDA where available, else the CPU), cpu, cuda or cuda:N", check=_device)
    quantization: str = setting(
        "auto", "auto: a GGUF's quantized weights stay quantized, float checkpoints stay float; "
        "none: dequantize at load; int8, int4: quantize a Hugging Face folder's matmul weights at "
        "load", choices=QUANTIZATION_CHOICES)
    quantization_group_size: int = setting(
        32, "inputs per scale for --quantization int8 or int4 (a multiple of 16; int4: 16 or a "
        "multiple of 32)")
    generation_config: str = setting(
        "auto", "sampling defaults for the fields a request leaves unset: auto (the model's "
        "generation_config.json), vllm or none (the library's), or a folder holding a "
        "generation_config.json", check=_generation_config)
    tensor_parallel_size: int = setting(
        1, "split the model over this many processes (docs/distributed.md)", aliases=("-tp",),
        check=check_positive_int)
    distributed_executor_backend: str = setting(
        "mp", "mp: the engine starts its tensor-parallel workers on this machine; "
        "external_launcher: they are started by torchrun or by hand",
        choices=DISTRIBUTED_EXECUTOR_BACKENDS)
    # A worker that hangs fails the engine after this; a dead worker fails the step at once.
    distributed_timeout_s: float = setting(
        120.0, "seconds a rank waits for the others in one collective before the engine fails",
        flag="--distributed-timeout", check=check_positive_seconds)
    # pagedllm.model.batch_invariant says what it covers.
    batch_invariant: bool = setting(
        False, "greedy outputs that do not depend on the batch, chunking or preemption (bf16 "
        "too; CPU only, one process; slower prefill)")
    enforce_eager: bool = setting(
        False, "no CUDA graphs: every decode step launched from Python (on a GPU, decode steps "
        "replay captured graphs otherwise: docs/gpu.md)")
    speculative_config: dict | str | None = setting(
        None, "speculative decoding, vLLM's shape as JSON: {\"method\": \"ngram\" | \"suffix\" | "
        "\"draft_model\", \"num_speculative_tokens\": k, ...} (pagedllm.spec_decode.config says every "
        "key; default: off)", parse=str, check=_speculative_config)
    decode_burst: int = setting(
        8, "decode steps a few greedy streams (up to 4 running, none waiting) run back to back in "
        "one engine step, sharing its Python (pagedllm.engine.decode_burst; 1: off)",
        check=check_positive_int)
    # LoRA adapters (pagedllm.lora, docs/lora.md): several fine-tunes of the base served at once.
    enable_lora: bool = setting(
        False, "serve LoRA adapters (PEFT's format) beside the base model, mixed in one batch")
    max_loras: int = setting(
        1, "LoRA adapters held in the model's slots at once (the most in one step)",
        check=check_positive_int)
    max_lora_rank: int = setting(16, "the largest LoRA rank an adapter may have", check=check_positive_int)
    max_cpu_loras: int | None = setting(
        None, "LoRA adapters kept read in memory, least recently used dropped first (default: "
        "--max-loras; at least that)", check=check_positive_int)
    lora_modules: tuple[str, ...] = setting(
        (), "LoRA adapters served from the start, as name=path (a PEFT adapter's folder); a "
        "request picks one by its model name", parse=str, nargs="+", check=_lora_modules)
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING, as a flag: loading code-bearing paths at a
    # client's word is for trusted deployments only.
    allow_runtime_lora_updating: bool = setting(
        False, "let the server's /v1/load_lora_adapter and /v1/unload_lora_adapter change the "
        "adapters while it runs")

    runner: str = setting(
        "generate", "generate: requests get tokens; pooling: requests get vectors (embeddings, "
        "scores) from the prompt's final hidden states, and no tokens", choices=RUNNERS)
    task: str | None = setting(
        None, "vLLM's spelling of --runner pooling: embed, score or reward (one pooling engine "
        "serves all three; with embed, a score is the cosine similarity of two embeddings instead of "
        "a reranker's verdict)",
        choices=POOLING_TASK_NAMES)
    pooling_type: str = setting(
        "last", "with --runner pooling, how an embedding pools the prompt's final hidden states: "
        "last (the last token's: Qwen3-Embedding and most causal embedders), mean (prefix caching "
        "then goes off: every token's state must be computed), cls (the first token's)",
        choices=POOLING_TYPES)
    pooling_normalize: bool = setting(
        True, "with --runner pooling, embeddings scaled to unit length unless a request asks otherwise")
    score_tokens: tuple[str, ...] = setting(
        ("no", "yes"), "with --runner pooling, the label tokens whose logits at the prompt's last "
        "token make a score (softmax over them; the positive label last): Qwen3-Reranker's no,yes",
        parse=_comma_list)

    cpu_isa: str = setting(
        "auto", "the CPU kernel tier: auto (the best this CPU runs), amx, avx512, avx2 or portable "
        "(torch alone); a tier above the CPU's is refused (docs/cpu-tiers.md)", check=_cpu_isa)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.speculative_method is None:  # "null" (a bench twin's plain engine): off, as unset
            self.speculative_config = None
        # The scheduler's own checks, so every entry point rejects the same values.
        SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len or 1,
                        step_share_tokens=self.step_share_tokens)
        group = self.quantization_group_size
        if group < 16 or group % 16 or (self.quantization == "int4" and group != 16 and group % 32):
            raise ValueError(f"quantization_group_size must be a multiple of 16 (int8) or 16 or a "
                             f"multiple of 32 (int4); got {group!r}")
        if self.batch_invariant and self.device.startswith("cuda"):
            raise ValueError("batch_invariant runs on the CPU only: the GPU kernels choose their "
                             f"own summation orders (device {self.device!r}); use --device cpu")
        if self.task is not None and self.runner != "pooling":
            # vLLM's spelling: the task names what the engine serves, a pooling runner.
            self.runner = "pooling"
        if len(self.score_tokens) < 2:
            raise ValueError(f"score_tokens must name at least two label tokens (the positive one "
                             f"last); got {self.score_tokens!r}")
        if self.batch_invariant and self.tensor_parallel_size > 1:
            raise ValueError("batch_invariant runs on one process: tensor parallelism sums partial "
                             "results across ranks in an order it does not fix; use "
                             "tensor_parallel_size 1")
        self._check_lora()
        if self.tensor_parallel_size > 1 and self.speculative_method == "draft_model":
            raise ValueError("speculative_config: method 'draft_model' runs on one process: the draft "
                             "is not split over tensor-parallel ranks yet; use tensor_parallel_size 1")

    def _check_lora(self) -> None:
        if not self.enable_lora:
            if self.lora_modules:
                raise ValueError("lora_modules needs enable_lora (--enable-lora)")
            return
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                             f"({self.max_loras})")
        if self.tensor_parallel_size > 1:
            raise ValueError("enable_lora runs on one process: LoRA is not split over tensor-parallel "
                             "ranks yet; use tensor_parallel_size 1")
        if self.batch_invariant:
            raise ValueError("enable_lora and batch_invariant cannot be combined: each adapter's "
                             "rows are summed as a group whose size depends on the batch")

    @property
    def speculative_method(self) -> str | None:
        """speculative_config's method (None: no speculative decoding)."""
        from pagedllm.spec_decode.config import SpeculativeConfig  # torch-free

        config = SpeculativeConfig.parse(self.speculative_config)
        return None if config is None else config.method

    @property
    def pooling_reads_every_token(self) -> bool:
        """Whether the engine pools over more than the last token (mean, cls): then no prompt may
        skip tokens through the prefix cache, whose hits give no hidden states."""
        return self.runner == "pooling" and self.pooling_type != "last"

    def describe_choices(self, dtype=None) -> str:
        """For the start-up line, the choices that change which code runs and that the device,
        dtype, KV plan and weights do not already say (the CPU kernels: for a model in dtype, the
        torch dtype it loaded in)."""
        parts = [f"prefix caching {'on' if self.enable_prefix_caching else 'off'}",
                 f"tensor_parallel_size {self.tensor_parallel_size}"]
        if self.tensor_parallel_size > 1:
            parts[-1] += f" ({self.distributed_executor_backend})"
        if self.batch_invariant:
            parts.append("batch-invariant")
        if self.runner == "pooling":
            parts.append(f"pooling runner ({self.pooling_type} pooling)")
        if self.speculative_config is not None:
            from pagedllm.spec_decode.config import SpeculativeConfig

            parts.append(SpeculativeConfig.parse(self.speculative_config).describe())
        from pagedllm.kernels import tiers  # the choice tiers.select made when the model loaded

        choice = tiers.chosen()
        if choice is not None and choice.describe(dtype):
            parts.append(choice.describe(dtype))
        return ", ".join(parts)


# -- command-line flags, derived from the fields ---------------------------------------------------
def flag_name(f: Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_config_args(parser: argparse.ArgumentParser, config_class: type, title: str | None = None) -> None:
    """One flag per field of config_class (a dataclass of `setting` fields): its type, default,
    help and choices are the field's, its dest the field's name. --help lists them under title,
    and the fields with a `group` under that heading."""
    hints = _type_hints(config_class)
    sections: dict[str | None, argparse._ActionsContainer] = {
        None: parser.add_argument_group(title) if title else parser}
    for f in fields(config_class):
        meta = f.metadata
        if meta.get("group") not in sections:
            sections[meta["group"]] = parser.add_argument_group(meta["group"])
        target = sections[meta.get("group")]
        default = f.default if f.default is not MISSING else None
        help_text = (meta.get("help") or "").replace("%", "%%")
        kwargs: dict = {"dest": f.name, "default": default}
        if bool in _type_args(hints[f.name]):
            kwargs["action"] = argparse.BooleanOptionalAction
            kwargs["help"] = f"{help_text} (default: {'on' if default else 'off'})"
        else:
            kwargs["type"] = _flag_type(f, hints[f.name], config_class)
            shown = ",".join(default) if isinstance(default, tuple) else "%(default)s"
            kwargs["help"] = help_text + (f" (default: {shown})" if default is not None else "")
            if meta.get("nargs"):
                kwargs["nargs"] = meta["nargs"]
            if meta.get("choices") is not None:
                kwargs["choices"] = meta["choices"]
            else:
                kwargs["metavar"] = flag_name(f).lstrip("-").replace("-", "_").upper()
        target.add_argument(flag_name(f), *meta.get("aliases", ()), **kwargs)


def _flag_type(f: Field, hint, config_class: type) -> Callable[[str], object]:
    """How a flag's text becomes the field's value: its parse, or the one of int, float, str it
    holds (None aside)."""
    if f.metadata.get("parse") is not None:
        return _argparse_type(f.metadata["parse"])
    plain = [t for t in _type_args(hint) if t is not type(None)]
    if len(plain) == 1 and plain[0] in (int, float, str):
        return plain[0]
    raise TypeError(f"{config_class.__name__}.{f.name}: a {hint} field needs setting(parse=...) "
                    "to have a flag")


def _argparse_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """parse with its ValueError's message shown by argparse as it is."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = parse.__name__
    return convert


def config_from_args(config_class: type, args: argparse.Namespace, **overrides):
    """The config the flags of add_config_args ask for (overrides on top), validated."""
    values = {f.name: getattr(args, f.name) for f in fields(config_class)}
    values = {name: tuple(v) if isinstance(v, list) else v for name, v in values.items()}  # nargs
    return config_class(**{**values, **overrides})


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, named like vLLM's: one per EngineConfig field."""
    add_config_args(parser, EngineConfig, "engine")


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    return config_from_args(EngineConfig, args, **overrides)
