"""Where each of our parameters comes from in a Hugging Face checkpoint: q/k/v and gate/up fused
into one weight each, Gemma's extra norms under their names, biases where the config has them;
and the state dict built from the loaded tensors (quantized parts kept as lists)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.model.config import ModelConfig
from pagedllm.model.quant_weight import QuantizedWeight


def _layer_names(config: ModelConfig, i: int) -> dict[str, list[str]]:
    """Our parameter name -> the Hugging Face tensors it is made of, for layer i."""
    layer, arch = f"model.layers.{i}", config.arch
    attn, mlp = f"{layer}.self_attn", f"{layer}.mlp"
    ours = f"layers.{i}"
    fused = arch.fused_checkpoint
    names = {
        f"{ours}.self_attn.qkv_proj.weight":
            [f"{attn}.qkv_proj.weight"] if fused else [f"{attn}.{p}_proj.weight" for p in "qkv"],
        f"{ours}.self_attn.o_proj.weight": [f"{attn}.o_proj.weight"],
        f"{ours}.mlp.gate_up_proj.weight":
            [f"{mlp}.gate_up_proj.weight"] if fused
            else [f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"],
        f"{ours}.mlp.down_proj.weight": [f"{mlp}.down_proj.weight"],
        f"{ours}.input_layernorm.weight": [f"{layer}.input_layernorm.weight"],
        f"{ours}.post_attention_layernorm.weight": [f"{layer}.post_attention_layernorm.weight"],
    }
    if config.is_moe_layer(i):
        del names[f"{ours}.mlp.gate_up_proj.weight"], names[f"{ours}.mlp.down_proj.weight"]
        names.update(_expert_names(config, i))
    if config.kv_lora_rank:
        del names[f"{ours}.self_attn.qkv_proj.weight"]
        names.update(_latent_attention_names(config, i))
    if arch.sandwich_norms:  # Gemma's post_attention_layernorm norms the attention output
        names[f"{ours}.post_attention_layernorm.weight"] = [
            f"{layer}.pre_feedforward_layernorm.weight"]
        names[f"{ours}.attn_output_norm.weight"] = [f"{layer}.post_attention_layernorm.weight"]
        names[f"{ours}.mlp_output_norm.weight"] = [f"{layer}.post_feedforward_layernorm.weight"]
    if arch.qk_norm:
        names[f"{ours}.self_attn.q_norm.weight"] = [f"{attn}.q_norm.weight"]
        names[f"{ours}.self_attn.k_norm.weight"] = [f"{attn}.k_norm.weight"]
    if config.attention_bias:
        names[f"{ours}.self_attn.qkv_proj.bias"] = [f"{attn}.{p}_proj.bias" for p in "qkv"]
    if config.output_bias:
        names[f"{ours}.self_attn.o_proj.bias"] = [f"{attn}.o_proj.bias"]
    if config.mlp_bias and not config.is_moe_layer(i):  # experts' biases: _expert_names
        names[f"{ours}.mlp.gate_up_proj.bias"] = [f"{mlp}.gate_proj.bias", f"{mlp}.up_proj.bias"]
        names[f"{ours}.mlp.down_proj.bias"] = [f"{mlp}.down_proj.bias"]
    if arch.attention_sinks:
        names[f"{ours}.self_attn.sinks"] = [f"{attn}.sinks"]
    return names


def _expert_names(config: ModelConfig, i: int) -> dict[str, list[str]]:
    """A mixture-of-experts layer's router, experts and shared expert (model/moe.py), from the
    per-expert names of Qwen2/Qwen3-MoE and DeepSeek, Mixtral's (w1 gate, w3 up, w2 down), or
    gpt-oss's router and its per-expert names as gpt_oss.py cuts them from the stacked tensors
    (biases too)."""
    ours = f"layers.{i}.mlp"
    if config.architecture == "MixtralForCausalLM":
        moe, gate, up, down = f"model.layers.{i}.block_sparse_moe", "w1", "w3", "w2"
    else:
        moe, gate, up, down = f"model.layers.{i}.mlp", "gate_proj", "up_proj", "down_proj"
    router = "router" if config.router_bias else "gate"  # gpt-oss calls it the router
    names = {f"{ours}.gate.weight": [f"{moe}.{router}.weight"]}
    if config.router_bias:
        names[f"{ours}.gate.bias"] = [f"{moe}.{router}.bias"]
    if config.topk_method == "noaux_tc":
        names[f"{ours}.score_bias"] = [f"{moe}.gate.e_score_correction_bias"]
    if config.shared_expert_intermediate_size:
        # Qwen2-MoE names its one shared expert in the singular, beside the gate that scales it.
        gated = config.arch.shared_expert_gate
        shared = f"{moe}.shared_expert" if gated else f"{moe}.shared_experts"
        names[f"{ours}.shared_experts.gate_up_proj.weight"] = [f"{shared}.gate_proj.weight",
                                                               f"{shared}.up_proj.weight"]
        names[f"{ours}.shared_experts.down_proj.weight"] = [f"{shared}.down_proj.weight"]
        if gated:
            names[f"{ours}.shared_expert_gate.weight"] = [f"{moe}.shared_expert_gate.weight"]
    for e in range(config.num_experts):
        theirs = f"{moe}.experts.{e}"
        names[f"{ours}.experts.{e}.gate_up_proj.weight"] = [f"{theirs}.{p}.weight" for p in (gate, up)]
        names[f"{ours}.experts.{e}.down_proj.weight"] = [f"{theirs}.{down}.weight"]
        if config.mlp_bias:
            names[f"{ours}.experts.{e}.gate_up_proj.bias"] = [f"{theirs}.{p}.bias" for p in (gate, up)]
            names[f"{ours}.experts.{e}.down_proj.bias"] = [f"{theirs}.{down}.bias"]
    return names


def _latent_attention_names(config: ModelConfig, i: int) -> dict[str, list[str]]:
    """DeepSeek's latent attention (model/mla.py), under its own names, nothing fused."""
    projections = ["kv_a_proj_with_mqa", "kv_b_proj"]
    projections += ["q_a_proj", "q_b_proj"] if config.q_lora_rank else ["q_proj"]
    norms = ["kv_a_layernorm"] + (["q_a_layernorm"] if config.q_lora_rank else [])
    attn = f"model.layers.{i}.self_attn"
    return {f"layers.{i}.self_attn.{name}.weight": [f"{attn}.{name}.weight"] for name in projections + norms}


def _parameter_sources(config: ModelConfig) -> dict[str, list[str]]:
    sources = {"embed_tokens.weight": ["model.embed_tokens.weight"],
               "norm.weight": ["model.norm.weight"]}
    if not config.tie_word_embeddings:
        sources["lm_head.weight"] = ["lm_head.weight"]
    if config.num_labels:  # a sequence classifier's head
        sources["score.weight"] = ["score.weight"]
    for i in range(config.num_hidden_layers):
        sources.update(_layer_names(config, i))
    return sources


def hf_tensor_names(config: ModelConfig) -> list[str]:
    """Every Hugging Face tensor name the model needs."""
    return [name for parts in _parameter_sources(config).values() for name in parts]


def fused_state_dict(
    config: ModelConfig, load: Callable[[str], torch.Tensor | QuantizedWeight],
    shard_parameter: Callable[[str, torch.Tensor | list[QuantizedWeight]], torch.Tensor | list] | None = None,
) -> dict[str, torch.Tensor | list[QuantizedWeight]]:
    """Our parameters from the loaded tensors; a weight kept quantized comes as the list of its
    quantized parts (fused later by QuantLinear), unless some part of it is float: then all are
    dequantized to the float parts' dtype and concatenated. shard_parameter: cuts each one to a
    tensor-parallel rank's share as soon as it is made (a whole weight at a time in memory)."""
    state = {}
    for ours, parts in _parameter_sources(config).items():
        tensors = [load(name) for name in parts]
        quantized = [t for t in tensors if isinstance(t, QuantizedWeight)]
        if len(quantized) == len(tensors):
            state[ours] = quantized
        else:
            dtype = next(t.dtype for t in tensors if not isinstance(t, QuantizedWeight))
            tensors = [t.dequantize(dtype) if isinstance(t, QuantizedWeight) else t for t in tensors]
            state[ours] = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
        if shard_parameter is not None:
            state[ours] = shard_parameter(ours, state[ours])
    return state
