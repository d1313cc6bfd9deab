"""Hybrid decoders: Qwen3.5 here (Granite 4 in granite_hybrid.py). In Qwen3.5 most layers are
Gated DeltaNets (model/gated_deltanet.py), which keep a fixed-size recurrent state per request;
every few layers a gated full-attention layer reads the paged KV cache. Llama's pre-norm residual
structure, MLP and LM head otherwise (the class reuses LlamaForCausalLM's logits, prepacking and
byte counts).

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
from pagedllm.model.errors import MissingTensorError, UnsupportedModelError, check_state_shapes
from pagedllm.model.gated_deltanet import GatedDeltaNet, state_shapes
from pagedllm.model.llama import MLP, LlamaForCausalLM, RMSNorm
from pagedllm.model.quant_weight import QuantizedWeight
from pagedllm.model.recurrent_state import StatePages
from pagedllm.model.rope import RotaryEmbedding, apply_rotary


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
    """Pre-norm residual layer: a mixer (recurrent, reading the request's state; or attention,
    reading the paged cache), then an MLP."""

    def __init__(self, config: ModelConfig, mixer: nn.Module, mlp: nn.Module, recurrent: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer, self.mlp, self.recurrent = mixer, mlp, recurrent


class HybridForCausalLM(LlamaForCausalLM):
    """Qwen3.5's hybrid; subclasses change the layers, the scalings and the checkpoint's names
    (granite_hybrid.py)."""

    def __init__(self, config: ModelConfig):
        nn.Module.__init__(self)
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.rotary = RotaryEmbedding(config) if config.use_rope else None
        self.layers = nn.ModuleList(self.make_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.vocab_gather = None
        self.embed_scale = None
        self.lora_embedding = self.lora_head = None  # LlamaForCausalLM's LoRA hooks (none here)
        self.state_shapes = self.request_state_shapes(config)
        self._states: StatePages | None = None  # over the runner's KV caches, made on first use

    @staticmethod
    def make_layer(config: ModelConfig, layer_index: int) -> HybridDecoderLayer:
        recurrent = config.layer_types[layer_index] == "linear_attention"
        mixer = GatedDeltaNet(config) if recurrent else GatedAttention(config)
        return HybridDecoderLayer(config, mixer, MLP(config), recurrent)

    @staticmethod
    def layer_state_shapes(config: ModelConfig) -> list[tuple[int, ...]]:
        """One recurrent layer's state tensors."""
        return state_shapes(config)

    @classmethod
    def request_state_shapes(cls, config: ModelConfig) -> list[tuple[int, ...]]:
        """One request's state: every recurrent layer's tensors, in layer order."""
        num_recurrent = config.num_hidden_layers - len(config.attention_layers)
        return cls.layer_state_shapes(config) * num_recurrent

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden]; writes the new K/V into kv_caches (one per attention layer)
        and each request's recurrent state into its state pages (attn_metadata.state_pages)."""
        if attn_metadata.state_pages is None:
            raise ValueError("a hybrid model's step needs each request's state pages")
        store = self._state_store(kv_caches)
        states = store.read(attn_metadata.state_pages, attn_metadata.state_fresh)
        x = self.embed(input_ids)
        if self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier
        cos, sin = self.rotary(positions, attn_metadata, x.dtype) if self.rotary is not None else (None, None)
        caches, recurrent = iter(kv_caches), iter(zip(states[0::2], states[1::2]))
        scale = self.config.residual_multiplier
        residual = None
        for layer in self.layers:
            if residual is None:
                x, residual = layer.input_layernorm(x), x
            else:
                x, residual = layer.input_layernorm(x, residual)
            if layer.recurrent:
                conv_state, ssm_state = next(recurrent)
                x = layer.mixer(x, conv_state, ssm_state, attn_metadata.query_start_loc_cpu)
            else:
                x = layer.mixer(x, cos, sin, next(caches), attn_metadata)
            x, residual = layer.post_attention_layernorm(x * scale if scale != 1.0 else x, residual)
            x = layer.mlp(x)
            if scale != 1.0:
                x = x * scale
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
        """Build the model from tensors under the checkpoint's Hugging Face names, fusing each
        layer's projections (one get_tensor call per name)."""
        if shard is not None:
            raise UnsupportedModelError("tensor parallelism is not supported for hybrid models")
        expected = cls.checkpoint_names(config)
        missing = sorted({_source_name(n) for group in expected.values() for n in group} - names)
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise MissingTensorError(
                f"the weights lack {len(missing)} tensors: {', '.join(missing[:5])}{more}")
        with torch.device("meta"):
            model = cls(dataclasses.replace(config, dtype=dtype))
        stacked: dict[str, torch.Tensor] = {}  # read once, then cut into its entries

        def read(name: str) -> torch.Tensor:
            tensor = get_tensor(name)
            if isinstance(tensor, QuantizedWeight):
                raise UnsupportedModelError(f"{name}: quantized weights are not supported for hybrid models")
            if cls.norm_offset(name):  # stored as offsets from 1
                tensor = tensor.float() + 1.0
            return tensor.to(device=device, dtype=dtype)

        def load(source: str) -> torch.Tensor:
            name = _source_name(source)
            if name == source:
                return read(name)
            if name not in stacked:
                stacked[name] = read(name)
            return stacked[name][int(source[len(name) + 1:-1])].clone()  # "name[e]": entry e

        state = {target: torch.cat([load(n) for n in sources]) if len(sources) > 1 else load(sources[0])
                 for target, sources in expected.items()}
        for name in [n for n in state if n.endswith("conv_weight")]:
            state[name] = state[name].squeeze(1)  # [channels, 1, kernel] -> [channels, kernel]
        check_state_shapes(model, state)
        model.load_state_dict(state, strict=True, assign=True)
        return model.requires_grad_(False).eval()

    @staticmethod
    def norm_offset(name: str) -> bool:
        """Whether the checkpoint stores this norm weight as an offset from 1: Qwen3.5's RMSNorms,
        but not its gated norm."""
        return name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or \
            name == "model.norm.weight"

    @staticmethod
    def checkpoint_names(config: ModelConfig) -> dict[str, list[str]]:
        return _checkpoint_names(config)


def _source_name(source: str) -> str:
    """The tensor's name in a source "name" or "name[index]"."""
    return source.split("[", 1)[0]


def common_checkpoint_names(config: ModelConfig) -> dict[str, list[str]]:
    """The embeddings, final norm, LM head and each layer's two norms, under transformers' names."""
    names = {"embed_tokens.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = ["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            names[f"layers.{i}.{norm}.weight"] = [f"model.layers.{i}.{norm}.weight"]
    return names


def _checkpoint_names(config: ModelConfig) -> dict[str, list[str]]:
    """Each of the model's parameters -> the checkpoint tensors concatenated into it ("name[e]":
    entry e of a stacked tensor)."""
    names = common_checkpoint_names(config)
    for i, kind in enumerate(config.layer_types):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        names[f"{ours}mlp.gate_up_proj.weight"] = [f"{theirs}mlp.{p}_proj.weight" for p in ("gate", "up")]
        names[f"{ours}mlp.down_proj.weight"] = [f"{theirs}mlp.down_proj.weight"]
        if kind == "linear_attention":
            src, dst = f"{theirs}linear_attn.", f"{ours}mixer."
            names[f"{dst}in_proj.weight"] = [f"{src}in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")]
            names[f"{dst}conv_weight"] = [f"{src}conv1d.weight"]
            names[f"{dst}norm_weight"] = [f"{src}norm.weight"]
            for same in ("dt_bias", "A_log", "out_proj.weight"):
                names[dst + same] = [src + same]
        else:
            src, dst = f"{theirs}self_attn.", f"{ours}mixer."
            names[f"{dst}qkv_proj.weight"] = [f"{src}{p}_proj.weight" for p in "qkv"]
            if config.attention_bias:
                names[f"{dst}qkv_proj.bias"] = [f"{src}{p}_proj.bias" for p in "qkv"]
                names[f"{dst}o_proj.bias"] = [f"{src}o_proj.bias"]
            for same in ("o_proj.weight", "q_norm.weight", "k_norm.weight"):
                names[dst + same] = [src + same]
    return names
