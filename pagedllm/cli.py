"""`pagedllm generate | chat | serve | bench ...`"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pagedllm.config import (
    DISTRIBUTED_EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    KV_LAYOUTS,
    QUANTIZATION_CHOICES,
    EngineConfig,
    engine_defaults,
)


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

                        batch_invariant=args.batch_invariant)


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")


def _sampling_params(args: argparse.Namespace):
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedllm.llm import LLM

    llm = LLM(**vars(engine_config_from_args(args)))
    output = llm.generate(args.prompt, _sampling_params(args), use_tqdm=False)[0]
    print(output.outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pagedllm.chat_repl import run_chat

    return run_chat(engine_config_from_args(args), _sampling_params(args), args.system)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt")
    add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streaming tokens as they come")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    for register in _optional_commands():
        register(sub)
    return parser


def _optional_commands():
    """Subcommands living in other modules (serve, bench), registered if present."""
    registrars = []
    try:
        from pagedllm.server.cli import register as register_serve
        registrars.append(register_serve)
    except ImportError:
        pass
    try:
        from pagedllm.bench.cli import register as register_bench
        registrars.append(register_bench)
    except ImportError:
        pass
    return registrars


def main(argv: list[str] | None = None) -> int:
    # Before torch is imported: OpenMP threads that spin forever between parallel regions
    # collapse throughput when another process shares the cores; a bounded spin kept idle-machine
    # speed and stayed fast under load (docs/benchmarks.md, CPU speed). The user's value wins.
    os.environ.setdefault("GOMP_SPINCOUNT", "100000")
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagedllm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
