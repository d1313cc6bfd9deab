"""Qwen3.5's hybrid decoder: most layers are Gated DeltaNets (model/gated_deltanet.py), which keep
a fixed-size recurrent state per request; every few layers a gated full-attention layer reads the
paged KV cache. Llama's pre-norm residual structure, MLP and LM head otherwise (the class reuses
LlamaForCausalLM's logits, prepacking and byte counts).

The runner allocates KV caches for the attention layers only (ModelConfig.attention_layers); the
recurrent states live in each request's state pages of the same pool (model/recurrent_state.py),
read before the layers run and written back after, once per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from pagedllm.kernels.attention import AttentionMetadata, KVCache, paged_attention, write_kv
from pagedllm.model.config import ModelConfig
from pagedllm.model.errors import MissingTensorError, UnsupportedModelError
from pagedllm.model.gated_deltanet import GatedDeltaNet, state_shapes
from pagedllm.model.llama import MLP, LlamaForCausalLM, RMSNorm
from pagedllm.model.quant_weight import QuantizedWeight
from pagedllm.model.recurrent_state import StatePages
from pagedllm.model.rope import RotaryEmbedding, apply_rotary


def recurrent_state_shapes(config: ModelConfig) -> list[tuple[int, ...]]:
    """Every recurrent layer's state tensors, in layer order: one request's whole state."""
    num_linear = config.num_hidden_layers - len(config.attention_layers)
    return state_shapes(config) * num_linear


class GatedAttention(nn.Module):
    """Full attention with q/k RMSNorm, partial rotary and a sigmoid gate per output channel
    (q_proj gives each head's query and its gate side by side)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, 2 * self.q_size + 2 * self.kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        query_gate, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        query_gate = query_gate.view(num_tokens, self.num_heads, 2 * self.head_dim)
        q, gate = query_gate[..., :self.head_dim], query_gate[..., self.head_dim:]
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim)), cos, sin)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        write_kv(k, v, key_cache, value_cache, attn_metadata.slot_mapping)
        out = paged_attention(q.contiguous(), key_cache, value_cache, attn_metadata, self.scale)
        out = out.reshape(num_tokens, self.q_size) * torch.sigmoid(gate.reshape(num_tokens, self.q_size))
        return self.o_proj(out)


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        recurrent = config.layer_types[layer_index] == "linear_attention"
        self.linear_attn = GatedDeltaNet(config) if recurrent else None
        self.self_attn = None if recurrent else GatedAttention(config)
        self.mlp = MLP(config)


class HybridForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig):
        nn.Module.__init__(self)
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(HybridDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.vocab_gather = None
        self.state_shapes = recurrent_state_shapes(config)
        self._states: StatePages | None = None  # over the runner's KV caches, made on first use

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden]; writes the new K/V into kv_caches (one per attention layer)
        and each request's recurrent state into its state pages (attn_metadata.state_pages)."""
        if attn_metadata.state_pages is None:
            raise ValueError("a hybrid model's step needs each request's state pages")
        store = self._state_store(kv_caches)
        states = store.read(attn_metadata.state_pages, attn_metadata.state_fresh)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, attn_metadata, x.dtype)
        caches, recurrent = iter(kv_caches), iter(zip(states[0::2], states[1::2]))
        residual = None
        for layer in self.layers:
            if residual is None:
                x, residual = layer.input_layernorm(x), x
            else:
                x, residual = layer.input_layernorm(x, residual)
            if layer.linear_attn is not None:
                conv_state, ssm_state = next(recurrent)
                x = layer.linear_attn(x, conv_state, ssm_state, attn_metadata.query_start_loc_cpu)
            else:
                x = layer.self_attn(x, cos, sin, next(caches), attn_metadata)
            x, residual = layer.post_attention_layernorm(x, residual)
            x = layer.mlp(x)
        store.write(attn_metadata.state_pages, states)
        return self.norm(x, residual)[0]

    def _state_store(self, kv_caches: list[KVCache]) -> StatePages:
        if self._states is None or self._states.caches is not kv_caches:
            self._states = StatePages(kv_caches, self.state_shapes)
        return self._states

    @classmethod
    def from_hf_tensors(cls, config: ModelConfig, names: set[str], get_tensor: Callable[[str], torch.Tensor],
                        dtype: torch.dtype, device: str | torch.device = "cpu",
                        shard=None) -> HybridForCausalLM:
        """Build the model from tensors under Qwen3.5's Hugging Face names, fusing each layer's
        projections (one get_tensor call per name)."""
        if shard is not None:
            raise UnsupportedModelError("tensor parallelism is not supported for hybrid models")
        expected = _checkpoint_names(config)
        missing = sorted(name for group in expected.values() for name in group if name not in names)
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise MissingTensorError(
                f"the weights lack {len(missing)} tensors: {', '.join(missing[:5])}{more}")
        with torch.device("meta"):
            model = cls(dataclasses.replace(config, dtype=dtype))

        def load(name: str) -> torch.Tensor:
            tensor = get_tensor(name)
            if isinstance(tensor, QuantizedWeight):
                raise UnsupportedModelError(f"{name}: quantized weights are not supported for hybrid models")
            if name.endswith("layernorm.weight") or name.endswith(("q_norm.weight", "k_norm.weight")) \
                    or name == "model.norm.weight":  # stored as offsets from 1 (not the gated norm's)
                tensor = tensor.float() + 1.0
            return tensor.to(device=device, dtype=dtype)

        state = {target: torch.cat([load(n) for n in sources]) if len(sources) > 1 else load(sources[0])
                 for target, sources in expected.items()}
        for name in [n for n in state if n.endswith("conv_weight")]:
            state[name] = state[name].squeeze(1)  # [channels, 1, kernel] -> [channels, kernel]
        model.load_state_dict(state, strict=True, assign=True)
        return model.requires_grad_(False).eval()


def _checkpoint_names(config: ModelConfig) -> dict[str, list[str]]:
    """Each of the model's parameters -> the checkpoint tensors concatenated into it."""
    names = {"embed_tokens.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = ["lm_head.weight"]
    for i, kind in enumerate(config.layer_types):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            names[f"{ours}{norm}.weight"] = [f"{theirs}{norm}.weight"]
        names[f"{ours}mlp.gate_up_proj.weight"] = [f"{theirs}mlp.{p}_proj.weight" for p in ("gate", "up")]
        names[f"{ours}mlp.down_proj.weight"] = [f"{theirs}mlp.down_proj.weight"]
        if kind == "linear_attention":
            src = f"{theirs}linear_attn."
            dst = f"{ours}linear_attn."
            names[f"{dst}in_proj.weight"] = [f"{src}in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")]
            names[f"{dst}conv_weight"] = [f"{src}conv1d.weight"]
            names[f"{dst}norm_weight"] = [f"{src}norm.weight"]
            for same in ("dt_bias", "A_log", "out_proj.weight"):
                names[dst + same] = [src + same]
        else:
            src, dst = f"{theirs}self_attn.", f"{ours}self_attn."
            names[f"{dst}qkv_proj.weight"] = [f"{src}{p}_proj.weight" for p in "qkv"]
            if config.attention_bias:
                names[f"{dst}qkv_proj.bias"] = [f"{src}{p}_proj.bias" for p in "qkv"]
                names[f"{dst}o_proj.bias"] = [f"{src}o_proj.bias"]
            for same in ("o_proj.weight", "q_norm.weight", "k_norm.weight"):
                names[dst + same] = [src + same]
    return names
