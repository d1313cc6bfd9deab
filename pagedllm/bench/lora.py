"""`pagedllm bench lora`: what serving LoRA adapters costs, in one run of one engine.

The default workload (64 requests, prompts 32-512, outputs 32-256 tokens) is run on the base model
alone, then with its requests spread round-robin over 1, 4 and 16 random adapters of rank 16 on
every q/k/v/o/gate/up/down projection (written here in PEFT's format), then on the base alone
again: the base's two runs bound the machine's drift. Each run starts with an empty prefix cache.
Then the resident memory over --cycles adapter cycles: each loads a fresh adapter (a new id, so
the core reads it again) and serves one short request with it, which evicts the least recently
used one from its slot and from memory; RSS is sampled as it goes and the KV blocks must all be
back at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
from pathlib import Path

import psutil
import torch

from pagedllm.bench.common import (
    add_threads_arg,
    apply_threads,
    engine_config,
    forget_cached_prefixes,
    print_table,
    run_workload,
    serve_one,
    write_json,
)
from pagedllm.bench.throughput import cpu_tier_fields
from pagedllm.bench.workload import load_workload, summarize
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.lora.adapter import LAYER_MODULES, PART_OF, projection_shape
from pagedllm.lora.request import LoRARequest
from pagedllm.model.config import ModelConfig
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def add_args(parser: argparse.ArgumentParser) -> None:
    add_threads_arg(parser)
    parser.add_argument("--adapter-counts", default="1,4,16",
                        help="adapters the workload's requests are spread over, one run each")
    parser.add_argument("--lora-rank", type=int, default=16, help="every adapter's rank")
    parser.add_argument("--cycles", type=int, default=200, help="adapter load/serve/evict cycles for RSS")
    parser.set_defaults(func=main, num_prompts=64, input_len="32-512", output_len="32-256")


def write_random_adapter(folder: Path, base: ModelConfig, rank: int, seed: int) -> Path:
    """A PEFT-format adapter on every q/k/v/o/gate/up/down projection of base (random weights)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(base.num_hidden_layers):
        for module in LAYER_MODULES:
            ours = PART_OF[module][0]
            if ours.startswith("mlp.") and base.is_moe_layer(layer):
                continue
            out_features, in_features = projection_shape(base, module)
            prefix = f"base_model.model.model.layers.{layer}.{ours.split('.')[0]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / 32
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) / 32
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(LAYER_MODULES)}))
    return folder


def main(args: argparse.Namespace) -> int:
    counts = [int(n) for n in args.adapter_counts.split(",")]
    apply_threads(args)
    engine = LLMEngine(engine_config(args, enable_lora=True, max_loras=max(counts),
                                     max_cpu_loras=max(counts), max_lora_rank=args.lora_rank))
    serve_one(engine)
    workload = load_workload(engine.tokenizer, args.dataset, args.num_prompts, args.input_len,
                             args.output_len, args.seed)
    with tempfile.TemporaryDirectory(prefix="pagedllm-lora-bench-") as root:
        folders = [write_random_adapter(Path(root) / f"a{i}", engine.model_config, args.lora_rank, i)
                   for i in range(max(counts))]
        adapters = [LoRARequest(f"a{i}", i + 1, str(folder)) for i, folder in enumerate(folders)]
        runs = [("base", _run(engine, workload, []))]
        runs += [(f"{n} adapter{'s' * (n > 1)}", _run(engine, workload, adapters[:n])) for n in counts]
        runs.append(("base again", _run(engine, workload, [])))
        rss = _cycles(engine, folders[:2], args.cycles, args.lora_rank)
    base_tok_s = (runs[0][1]["output_tok_s"] + runs[-1][1]["output_tok_s"]) / 2
    rows = [[label, run["output_tok_s"], f"{run['output_tok_s'] / base_tok_s:.2f}x", run["elapsed_s"]]
            for label, run in runs]
    title = f"LoRA, rank {args.lora_rank}, {len(workload)} requests (x: against the base's two runs' mean)"
    print_table(title, ["requests on", "output tok/s", "x base", "elapsed s"], rows)
    print(f"\nRSS over {args.cycles} adapter cycles (MiB): " + ", ".join(f"{k}: {v}" for k, v in rss.items()))
    write_json(args.output_json, {"workload": summarize(workload), "lora_rank": args.lora_rank,
                                  "runs": dict(runs), "rss_mib_by_cycle": rss,
                                  **cpu_tier_fields(engine.device)})
    return 0


def _run(engine: LLMEngine, workload, adapters: list[LoRARequest]) -> dict:
    forget_cached_prefixes(engine)
    result = run_workload(engine, workload, tag=f"lora{len(adapters)}", loras=adapters)
    logger.info("%d adapters: %.1f output tok/s", len(adapters), result.output_tokens / result.elapsed_s)
    return {"output_tok_s": round(result.output_tokens / result.elapsed_s, 1),
            "elapsed_s": round(result.elapsed_s, 2), "num_preemptions": result.num_preemptions}


def _cycles(engine: LLMEngine, folders: list[Path], cycles: int, rank: int) -> dict[int, float]:
    """RSS (MiB) after cycle 0 and every tenth of the way: each cycle loads a fresh adapter into
    the core and serves a short request with it."""
    sample_every = max(1, math.ceil(cycles / 10))
    rss: dict[int, float] = {}
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for i in range(cycles + 1):
        lora = LoRARequest(f"cycle{i}", 10_000 + i, str(folders[i % len(folders)]))
        engine.engine_core.load_lora(lora)
        engine.add_request(f"cycle{i}", {"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}, params,
                           lora_request=lora)
        while engine.has_unfinished_requests():
            engine.step()
        if i % sample_every == 0:
            rss[i] = round(psutil.Process().memory_info().rss / 2**20, 1)
    if engine.stats().kv.num_used_blocks:
        raise RuntimeError(f"{engine.stats().kv.num_used_blocks} KV blocks still held after the cycles")
    return rss
