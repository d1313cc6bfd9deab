"""`pagedllm bench memory --families`: what one token and one request cost in KV memory, and how
many requests at once a fixed budget holds, for model families of about the same size that keep
their context differently: grouped-query attention (keys and values per KV head per layer), hybrids
(a few attention layers; the others' fixed-size recurrent state per request, in pages of the same
pool) and multi-head latent attention (one latent per token per layer).

The figures are the engine's own plan (core_loader.plan_model_kv_cache, the function the engine
plans its cache with) for each family's shape, read from a config.json-like dict: no weights, no
timing. Parameters are counted on the meta device. A model's path (--model) can be compared too:
only its config is read.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from pagedllm.bench.common import print_table, write_json
from pagedllm.config import EngineConfig, parse_size
from pagedllm.engine.core_loader import plan_model_kv_cache
from pagedllm.model.config import ModelConfig, parse_dtype_name
from pagedllm.model.loader import model_class, read_model_config, recurrent_state_shapes
from pagedllm.model.recurrent_state import state_bytes

DEFAULT_BUDGET = "1GiB"

_QWEN_VOCAB = dict(vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                   tie_word_embeddings=True, hidden_size=2048, num_hidden_layers=28)

# name -> (what it is shaped like, its config.json). 28 layers and hidden size 2048 each, ~1.7-1.9B
# parameters: the attention is what differs.
FAMILY_SHAPES: dict[str, tuple[str, dict]] = {
    "gqa": ("Qwen3-1.7B: 16 query heads, 8 KV heads of 128", dict(
        architectures=["Qwen3ForCausalLM"], intermediate_size=6144, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, rope_theta=1e6, **_QWEN_VOCAB)),
    "hybrid-deltanet": ("Qwen3.5-style: Gated DeltaNet, 1 layer in 4 attends (8 heads, 2 KV of 256)", dict(
        architectures=["Qwen3_5ForCausalLM"], intermediate_size=6144, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25, rope_theta=1e7,
        full_attention_interval=4, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, **_QWEN_VOCAB)),
    "hybrid-mamba2": ("Granite-4-H-style: Mamba2 (64 heads of 64, state 128), 1 layer in 4 attends", dict(
        architectures=["GraniteMoeHybridForCausalLM"], intermediate_size=6144,
        shared_intermediate_size=6144, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
        rope_theta=1e7, position_embedding_type="rope", mamba_n_heads=64, mamba_d_head=64,
        mamba_expand=2, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4,
        layer_types=["attention" if i % 4 == 3 else "mamba" for i in range(28)], **_QWEN_VOCAB)),
    "mla": ("DeepSeek-V2-Lite's attention (latent 512 + rotary 64), dense MLP", dict(
        architectures=["DeepseekV2ForCausalLM"], intermediate_size=6144, num_attention_heads=16,
        num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, rope_theta=1e4, **_QWEN_VOCAB)),
}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--families", action="store_true",
                        help="bytes per KV token and requests at once in a fixed budget (--kv-cache-memory, "
                             f"default {DEFAULT_BUDGET}) for a GQA, two hybrid and an MLA model of ~1.8B "
                             "parameters, from their shapes (no weights, no timing); --model adds yours")


def family_figures(config: ModelConfig, budget: str, max_model_len: int, block_size: int,
                   dtype: torch.dtype) -> dict:
    """The engine's KV plan for a model of this shape: bytes per token and per request, and how
    many max_model_len requests the budget holds at once."""
    engine_config = EngineConfig(kv_cache_memory=budget, max_model_len=max_model_len,
                                 block_size=block_size, enable_prefix_caching=False)
    shapes = recurrent_state_shapes(config)
    figures = {"architecture": config.architecture, "parameters": _parameter_count(config),
               "layers": config.num_hidden_layers, "kv_layers": len(config.attention_layers),
               "state_bytes_per_request": state_bytes(shapes)}
    try:
        plan = plan_model_kv_cache(engine_config, config, dtype, config.num_key_value_heads, shapes)
    except ValueError as exc:  # one request does not fit: the plan says by how much
        figures.update(requests_at_once=0, does_not_fit=str(exc))
        fitted = dataclasses.replace(engine_config, max_model_len=None)  # for the sizes alone
        plan = plan_model_kv_cache(fitted, config, dtype, config.num_key_value_heads, shapes)
    return {
        "kv_kind": plan.kv_kind,
        "bytes_per_token": plan.bytes_per_block // plan.block_size,
        "state_pages_per_request": plan.state_pages_per_request,
        "bytes_per_request": plan.blocks_per_request * plan.bytes_per_block,
        "num_blocks": plan.num_blocks,
        "blocks_per_request": plan.blocks_per_request,
        "requests_at_once": plan.num_blocks // plan.blocks_per_request,
        **figures,
    }


def _parameter_count(config: ModelConfig) -> int:
    with torch.device("meta"):  # shapes only: no memory, no initialization
        model = model_class(config)(config)
    return sum(p.numel() for p in model.parameters())


def main(args: argparse.Namespace) -> int:
    budget = args.kv_cache_memory or DEFAULT_BUDGET
    max_model_len = args.max_model_len or 1024
    dtype = torch.bfloat16 if args.dtype in (None, "auto") else parse_dtype_name(args.dtype)
    configs = {name: ModelConfig.from_hf_config(config) for name, (_, config) in FAMILY_SHAPES.items()}
    if args.model:
        configs[str(args.model)] = read_model_config(args.model)
    rows = {name: family_figures(config, budget, max_model_len, args.block_size, dtype)
            for name, config in configs.items()}
    baseline = rows["gqa"]["requests_at_once"]
    for figures in rows.values():
        figures["requests_vs_gqa"] = round(figures["requests_at_once"] / baseline, 2) if baseline else None
    payload = {"kv_budget_bytes": parse_size(budget), "max_model_len": max_model_len,
               "block_size": args.block_size, "dtype": str(dtype).removeprefix("torch."),
               "shapes": {name: FAMILY_SHAPES[name][0] for name in FAMILY_SHAPES}, "families": rows}
    _print(payload)
    write_json(args.output_json, payload)
    return 0


def _print(p: dict) -> None:
    rows = [[name, f"{r['parameters'] / 1e9:.2f}B", f"{r['kv_layers']}/{r['layers']}", r["kv_kind"],
             _kib(r["bytes_per_token"]), _mib(r["state_bytes_per_request"]),
             _mib(None if "does_not_fit" in r else r["bytes_per_request"]),
             r["requests_at_once"], "-" if r["requests_vs_gqa"] is None else f"{r['requests_vs_gqa']}x"]
            for name, r in p["families"].items()]
    print_table(f"KV memory by family: {p['kv_budget_bytes'] / 2**30:g} GiB budget, requests of "
                f"{p['max_model_len']} tokens, {p['dtype']}, block {p['block_size']}",
                ["family", "params", "KV layers", "pages", "KV per token", "state per request",
                 "per request", "requests at once", "vs GQA"], rows)
    for name, shape in p["shapes"].items():
        print(f"  {name}: {shape}")
    for name, r in p["families"].items():
        if "does_not_fit" in r:
            print(f"  {name} does not fit: {r['does_not_fit']}")


def _kib(size: int | None) -> str:
    return "-" if size is None else f"{size / 1024:.1f} KiB"


def _mib(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**20:.1f} MiB"
