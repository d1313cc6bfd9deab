"""Granite 4's hybrid decoder (transformers' granitemoehybrid): Mamba2 layers (model/mamba2.py)
with an attention layer every few, each layer's MLP a shared gated MLP beside routed experts (or
alone, in the dense sizes), and Granite's scalings (ModelConfig.embedding_multiplier and the
others). The recurrent states live in the request's state pages as for Qwen3.5 (hybrid.py, whose
forward pass and loading this reuses).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels.attention import AttentionMetadata, KVCache, paged_attention, write_kv
from pagedllm.model.config import ModelConfig
from pagedllm.model.hybrid import HybridDecoderLayer, HybridForCausalLM, common_checkpoint_names
from pagedllm.model.llama import MLP
from pagedllm.model.mamba2 import Mamba2Mixer, state_shapes
from pagedllm.model.moe import SparseMoE
from pagedllm.model.rope import apply_rotary


class GraniteAttention(nn.Module):
    """Attention scaled by attention_multiplier, with rotary or no position embedding at all."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = config.attention_multiplier
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if cos is not None:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        key_cache, value_cache = kv_cache
        write_kv(k, v.reshape(num_tokens, self.num_kv_heads, self.head_dim), key_cache, value_cache,
                 attn_metadata.slot_mapping)
        out = paged_attention(q.contiguous(), key_cache, value_cache, attn_metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class GraniteHybridForCausalLM(HybridForCausalLM):
    @staticmethod
    def make_layer(config: ModelConfig, layer_index: int) -> HybridDecoderLayer:
        recurrent = config.layer_types[layer_index] == "linear_attention"
        mixer = Mamba2Mixer(config) if recurrent else GraniteAttention(config)
        if config.num_experts:
            experts = [MLP(config, config.moe_intermediate_size) for _ in range(config.num_experts)]
            mlp = SparseMoE(config, experts, MLP(config, config.shared_expert_intermediate_size))
        else:
            mlp = MLP(config)  # the shared MLP alone (intermediate_size is its width)
        return HybridDecoderLayer(config, mixer, mlp, recurrent)

    @staticmethod
    def layer_state_shapes(config: ModelConfig) -> list[tuple[int, ...]]:
        return state_shapes(config)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return super().compute_logits(hidden / self.config.logits_scaling)

    @staticmethod
    def norm_offset(name: str) -> bool:
        return False

    @staticmethod
    def checkpoint_names(config: ModelConfig) -> dict[str, list[str]]:
        """Each parameter -> the checkpoint tensors concatenated into it ("name[e]": expert e of the
        stacked [experts, ...] tensors)."""
        names = common_checkpoint_names(config)
        for i, kind in enumerate(config.layer_types):
            ours, theirs = f"layers.{i}.", f"model.layers.{i}."
            shared = f"{ours}mlp.shared_experts." if config.num_experts else f"{ours}mlp."
            names[f"{shared}gate_up_proj.weight"] = [f"{theirs}shared_mlp.input_linear.weight"]
            names[f"{shared}down_proj.weight"] = [f"{theirs}shared_mlp.output_linear.weight"]
            if config.num_experts:
                moe = f"{theirs}block_sparse_moe."
                names[f"{ours}mlp.gate.weight"] = [f"{moe}router.layer.weight"]
                for e in range(config.num_experts):
                    names[f"{ours}mlp.experts.{e}.gate_up_proj.weight"] = [f"{moe}input_linear.weight[{e}]"]
                    names[f"{ours}mlp.experts.{e}.down_proj.weight"] = [f"{moe}output_linear.weight[{e}]"]
            if kind == "linear_attention":
                src, dst = f"{theirs}mamba.", f"{ours}mixer."
                names[f"{dst}conv_weight"] = [f"{src}conv1d.weight"]
                names[f"{dst}norm_weight"] = [f"{src}norm.weight"]
                same = ["in_proj.weight", "out_proj.weight", "dt_bias", "A_log", "D"]
                same += ["conv1d.bias"] * config.mamba_conv_bias
                same += ["in_proj.bias", "out_proj.bias"] if config.mamba_proj_bias else []
                for name in same:
                    names[dst + name.replace("conv1d.bias", "conv_bias")] = [src + name]
            else:
                src, dst = f"{theirs}self_attn.", f"{ours}mixer."
                names[f"{dst}qkv_proj.weight"] = [f"{src}{p}_proj.weight" for p in "qkv"]
                names[f"{dst}o_proj.weight"] = [f"{src}o_proj.weight"]
                if config.attention_bias:
                    names[f"{dst}qkv_proj.bias"] = [f"{src}{p}_proj.bias" for p in "qkv"]
                    names[f"{dst}o_proj.bias"] = [f"{src}o_proj.bias"]
        return names
