"""A Llama-family decoder whose attention reads the paged KV cache: Llama, Mistral, Qwen2/Qwen3,
Gemma 2/3, Phi-3 and the mixtures of experts (Qwen3-MoE, Mixtral, DeepSeek, gpt-oss), each
family's departures from Llama read from config.arch (architectures.py) and the config's numbers,
in a few visible lines where they apply.

One flat batch of T tokens from many requests goes through each layer together; only attention
looks at request boundaries, through AttentionMetadata. Weights are fused at load time (one
q/k/v projection, one gate/up projection): fewer, larger matmuls are faster on CPU.

Where the chosen CPU kernel tier has compiled kernels (pagedllm.kernels.tiers: read once, when a
layer is built), the elementwise work between the matmuls runs fused: the residual add inside
RMSNorm, rotary in place on the q/k/v rows, SiLU-and-mul; and prepack_for_cpu() packs bf16 matmul
weights once for the CPU's matmul kernels (packed_linear.py). Elsewhere the plain torch code below
runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import elementwise
from pagedllm.kernels.attention import AttentionMetadata, KVCache, paged_attention, write_kv
from pagedllm.model.architectures import ACTIVATIONS
from pagedllm.model.config import ModelConfig
from pagedllm.model.errors import MissingTensorError, check_state_shapes
from pagedllm.model.mla import MLAttention
from pagedllm.model.moe import SparseMoE
from pagedllm.model.packed_linear import PackedLinear, can_pack
from pagedllm.model.quant_linear import QuantEmbedding, QuantLinear, interleave_for_int8
from pagedllm.model.quant_weight import QuantizedWeight
from pagedllm.model.rope import RotaryEmbedding, apply_rotary
from pagedllm.model.torch_int4_linear import TorchInt4Linear, pack_for_torch, runs_here
from pagedllm.model.weight_names import fused_state_dict, hf_tensor_names

if TYPE_CHECKING:
    from pagedllm.distributed.shard import RankShard
    from pagedllm.model.decode_layers import DecodeLayers


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused_ops = elementwise.fused_ops_chosen()  # the kernel tier's choice, made at load

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); or, given the residual stream, (norm(x + residual), x + residual)."""
        fused = (self.fused_ops and elementwise.takes(x) and x.dim() == 2 and x.is_contiguous()
                 and self.weight.dtype == x.dtype)
        if residual is None:
            return elementwise.rms_norm(x, self.weight, self.eps) if fused else self._norm(x)
        if fused and residual.is_contiguous() and residual.dtype == x.dtype:
            elementwise.add_rms_norm_(x, residual, self.weight, self.eps)  # both in place
            return x, residual
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 whatever the weights' dtype, as the reference does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.softcap = config.attn_logit_softcapping
        self.sliding_window = config.layer_window(layer_index)
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.output_bias)
        # gpt-oss: each head's learned logit in its softmax's denominator (kernels/attention).
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if config.arch.attention_sinks else None
        self.q_norm = self.k_norm = None
        if config.arch.qk_norm:  # over each head, before rotary
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        # Rotary in place on the q/k/v rows needs whole heads rotated, and q and k as projected or
        # normalized in place (Qwen3's q/k norms, by the compiled RMSNorm: _norm_heads_).
        self.rotary_in_place = config.rotary_dim == self.head_dim and elementwise.fused_ops_chosen()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if (self.rotary_in_place and elementwise.takes(qkv) and qkv.stride(-1) == 1
                and cos.is_contiguous() and self._norm_heads_(qkv)):
            # Rotate q and k where they are, then take views: no copies.
            elementwise.rotary_(qkv, cos, sin, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(num_tokens, self.num_heads, self.head_dim)
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(num_tokens, self.num_heads, self.head_dim)
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        write_kv(k, v, key_cache, value_cache, attn_metadata.slot_mapping)
        # Sinks passed only where the model has them: the kernels' own entry points, which take the
        # dispatcher's place in some tests, have none.
        sinks = {} if self.sinks is None else {"sinks": self.sinks}
        out = paged_attention(q, key_cache, value_cache, attn_metadata, self.scale,
                              sliding_window=self.sliding_window, softcap=self.softcap, **sinks)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def _norm_heads_(self, qkv: torch.Tensor) -> bool:
        """Qwen3's q/k norms on each head of q and k, written back into the q/k/v rows (as the
        one-call decode does, csrc/decode_layers.cpp); whether q and k are ready for rotary in
        place (False: norms the compiled RMSNorm does not take, for the torch path)."""
        if self.q_norm is None:
            return True
        norms = (self.q_norm, self.k_norm)
        if any(n.weight.dtype != qkv.dtype for n in norms):
            return False
        q_norm, k_norm = norms
        elementwise.rms_norm_heads_(qkv, 0, self.num_heads, self.head_dim, q_norm.weight, q_norm.eps)
        elementwise.rms_norm_heads_(qkv, self.num_heads, self.num_kv_heads, self.head_dim, k_norm.weight,
                                    k_norm.eps)
        return True


class MLP(nn.Module):
    """A gated MLP, down(act(gate(x)) * up(x)), with gate and up as one matmul: SwiGLU (SiLU) for
    most families, GeGLU (tanh-approximated GELU) for Gemma."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        self.intermediate_size = intermediate_size or config.intermediate_size  # an expert's own
        self.act = ACTIVATIONS[config.hidden_act]
        # gpt-oss's clamped SwiGLU (ModelConfig.swiglu_limit) in place of act(gate) * up.
        self.swiglu_limit, self.swiglu_alpha = config.swiglu_limit, config.swiglu_alpha
        # The compiled kernels do SiLU-and-mul.
        self.fused_silu = config.hidden_act == "silu" and self.swiglu_limit is None
        self.silu_kernel = self.fused_silu and elementwise.fused_ops_chosen()  # chosen at load
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * self.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(
            self.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if getattr(self.gate_up_proj, "gated_silu", False):  # SiLU-and-mul done (packed_linear.py)
            return self.down_proj(gate_up)
        if self.silu_kernel and elementwise.takes(gate_up) and gate_up.stride(-1) == 1:
            return self.down_proj(elementwise.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        if self.swiglu_limit is not None:
            return self.down_proj(self._clamped_swiglu(gate, up))
        return self.down_proj(self.act(gate) * up)

    def _clamped_swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gpt-oss's activation, in transformers' order of operations."""
        gate = gate.clamp(max=self.swiglu_limit)
        up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.swiglu_alpha))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = (MLAttention(config, layer_index, RMSNorm) if config.kv_lora_rank
                          else Attention(config, layer_index))
        # The norm before the MLP, under Llama's name (Gemma calls it pre_feedforward_layernorm).
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        if config.is_moe_layer(layer_index):
            shared = config.shared_expert_intermediate_size
            self.mlp = SparseMoE(config, [MLP(config, config.moe_intermediate_size)
                                          for _ in range(config.num_experts)],
                                 MLP(config, shared) if shared else None)
        self.attn_output_norm = self.mlp_output_norm = None
        if config.arch.sandwich_norms:
            self.attn_output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.mlp_output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.uses_local_rope = config.uses_local_rope(layer_index)

    def forward(self, x, residual, cos, sin, kv_cache: KVCache, attn_metadata: AttentionMetadata):
        """x: the previous layer's MLP output (or the embeddings, with residual None); returns this
        layer's MLP output and the residual stream, whose sum is the layer's output."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, kv_cache, attn_metadata)
        if self.attn_output_norm is not None:
            x = self.attn_output_norm(x)
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        if self.mlp_output_norm is not None:
            x = self.mlp_output_norm(x)
        return x, residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # Passing the (uninitialized) weight skips a random init that is always overwritten
        # and, on the meta device, costs a second of one-time imports.
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size))
        # Gemma multiplies the embeddings by sqrt(hidden_size), rounded to the weights' dtype.
        self.embed_scale = config.hidden_size**0.5 if config.arch.scaled_embeddings else None
        self.rotary = RotaryEmbedding(config)
        self.local_rotary = (RotaryEmbedding(config, local=True)
                             if config.local_rope_theta is not None else None)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        # A *ForSequenceClassification checkpoint's head: label logits from the last hidden state.
        self.score = (nn.Linear(config.hidden_size, config.num_labels, bias=False)
                      if config.num_labels else None)
        # Under tensor parallelism (pagedllm.distributed), set by the shard: the whole
        # vocabulary's logits on rank 0 from every rank's share of the LM head (None elsewhere).
        self.vocab_gather: Callable[[torch.Tensor], torch.Tensor | None] | None = None
        # Set by the runner once its KV caches exist, where the model qualifies: decode steps then
        # run every layer in one compiled call (decode_layers.py).
        self.decode_layers: DecodeLayers | None = None
        # LoRA on the embeddings and the LM head (pagedllm/lora/layers.py, set by its wrap_model):
        # updates added to the base's embeddings and logits.
        self.lora_embedding: nn.Module | None = None
        self.lora_head: nn.Module | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of a flat batch's tokens (their adapters' updates included)."""
        x = self.embed_tokens(input_ids)
        if self.lora_embedding is not None:
            x = self.lora_embedding.add_update(x, input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat batch; writes the new K/V into kv_caches."""
        x = self.embed(input_ids)
        rope = self.rotary(positions, attn_metadata, x.dtype)
        local_rope = (self.local_rotary(positions, attn_metadata, x.dtype)
                      if self.local_rotary is not None else rope)
        fused = self.decode_layers
        if fused is not None and fused.takes(x, kv_caches, attn_metadata):
            return fused.run(x, *rope, attn_metadata)
        residual = None  # the residual add is folded into the next RMSNorm
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            cos, sin = local_rope if layer.uses_local_rope else rope
            x, residual = layer(x, residual, cos, sin, kv_cache, attn_metadata)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits [N, vocab] for the rows of hidden that need sampling (under tensor
        parallelism: on rank 0, None on the others)."""
        packed = getattr(self, "_packed_lm_head", None)  # prepacked bf16, or quantized
        if packed is not None:
            logits = packed(hidden).float()
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(hidden, weight).float()
        if self.lora_head is not None:  # before the capping, as PEFT adds it to the head's output
            logits = self.lora_head.add_update(logits, hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        return logits if self.vocab_gather is None else self.vocab_gather(logits)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 label logits [N, num_labels] of a sequence classifier's rows (its score head is
        whole on every rank; on a bf16 CPU it is prepacked like every linear layer)."""
        return self.score(hidden).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """compute_logits(hidden).max(-1).indices, int64 [N] (None on a tensor-parallel worker):
        without storing the logits where the packed LM head can (packed_linear.py), and on the
        head's own output where it is quantized (QuantLinear.argmax: in the head's own call): bf16
        widens to float32 exactly, so the maximum and its first index are the same."""
        head = getattr(self, "_packed_lm_head", None)
        if (head is not None and self.vocab_gather is None
                and self.config.final_logit_softcapping is None  # capping can tie distinct logits
                and (self.lora_head is None or not self.lora_head.updates_any())):
            if isinstance(head, PackedLinear):
                return head.argmax(hidden)
            if isinstance(head, QuantLinear):
                return head.argmax(hidden)
        logits = self.compute_logits(hidden)
        return None if logits is None else logits.max(dim=-1).indices

    def prepack_for_cpu(self, max_num_tokens: int) -> bool:
        """Pack the bf16 matmul weights (and a copy of a tied LM head) for the CPU's matmul kernels
        (packed_linear.py: the same results as F.linear but for an element now and then one bf16
        step apart), and lay quantized ones out for the tier's int8 kernel where it has one
        (quant_linear.interleave_for_int8), or in torch's int4 layout where the tier has no
        quantized matmul of ours (torch_int4_linear.py). Only for bfloat16 on CPU; returns whether
        it packed float weights."""
        weight = self.norm.weight
        if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
            return False
        interleave_for_int8(self)
        if runs_here(weight.dtype):
            pack_for_torch(self)
        if not can_pack(max_num_tokens):
            return False
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    gated = isinstance(module, MLP) and module.fused_silu and name == "gate_up_proj"
                    setattr(module, name, PackedLinear(child.weight, child.bias, max_num_tokens, gated))
        if isinstance(getattr(self, "_packed_lm_head", None), (QuantLinear, TorchInt4Linear)):
            pass  # a quantized head stays as it is
        elif self.lm_head is not None:
            self._packed_lm_head = self.lm_head  # packed by the loop above
        else:
            self._packed_lm_head = PackedLinear(self.embed_tokens.weight, None, max_num_tokens)
        return True

    def set_lm_head_kernel(self, head: nn.Module) -> None:
        """The module compute_logits runs the LM head with from now on (prepacked, quantized, or
        batch_invariant.py's invariant one)."""
        self._packed_lm_head = head

    def weight_bytes(self) -> int:
        """Bytes of every weight the model holds (quantized, float, prepacked copies), each once."""
        seen: dict[int, int] = {}
        for module in self.modules():
            tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            if isinstance(module, QuantLinear):
                tensors += [t for p in module.parts for t in (p.codes, p.scales, p.mins, p.codebook)]
            elif isinstance(module, QuantEmbedding):
                w = module.weight_q
                tensors += [w.codes, w.scales, w.mins, w.codebook]
            elif isinstance(module, TorchInt4Linear):
                tensors += module.tensors()
            elif isinstance(module, PackedLinear):
                tensors += [module.packed_weight, getattr(module, "bias_f32", None)]
            for t in tensors:
                if t is not None and t.device.type != "meta":
                    seen[t.data_ptr() if t.layout == torch.strided else id(t)] = t.numel() * t.element_size()
        return sum(seen.values())

    @classmethod
    def from_hf_tensors(
        cls,
        config: ModelConfig,
        names: set[str],
        get_tensor: Callable[[str], torch.Tensor],
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        shard: RankShard | None = None,
    ) -> LlamaForCausalLM:
        """Build the model from tensors under Hugging Face names, fusing q/k/v and gate/up.

        get_tensor is called once per name, so weights can stream from a memory map or be
        dequantized one at a time. shard: only one tensor-parallel rank's share, each weight cut
        as it is loaded (pagedllm.distributed.shard).
        """
        missing = sorted(set(hf_tensor_names(config)) - names)
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise MissingTensorError(
                f"the weights lack {len(missing)} tensors: {', '.join(missing[:5])}{more}")
        # Built on the meta device: no memory or random init for weights about to be replaced.
        # (The rotary frequencies are built on the CPU explicitly, so they survive this.)
        with torch.device("meta"):
            model = cls(dataclasses.replace(config if shard is None else shard.rank_config(), dtype=dtype))

        offset = config.arch.norm_offset

        def load(name: str) -> torch.Tensor | QuantizedWeight:
            tensor = get_tensor(name)
            if isinstance(tensor, QuantizedWeight):
                return tensor
            if offset and name.endswith("norm.weight"):  # stored as offsets (Gemma): fold them in
                tensor = tensor.float() + offset
            return tensor.to(device=device, dtype=dtype)

        state = fused_state_dict(config, load, None if shard is None else shard.shard_parameter)
        model._install_quantized({name: state.pop(name) for name in list(state)
                                  if isinstance(state[name], list)}, dtype)
        check_state_shapes(model, state)
        model.load_state_dict(state, strict=True, assign=True)
        if shard is not None:
            shard.parallelize(model)
        return model.requires_grad_(False).eval()

    def _install_quantized(self, weights: dict[str, list[QuantizedWeight]], dtype: torch.dtype) -> None:
        """Swap in quantized modules for the weights kept quantized (their tensors are not in the
        state dict, so the float ones then load strictly). A tied LM head multiplies by the
        embedding's own quantized table."""
        for name, parts in weights.items():
            path = name.removesuffix(".weight")
            parent_path, _, attr = path.rpartition(".")
            parent = self.get_submodule(parent_path) if parent_path else self
            if attr == "embed_tokens":
                module = QuantEmbedding(parts[0], dtype)
                if self.lm_head is None:
                    self._packed_lm_head = QuantLinear(parts)
            else:
                old = getattr(parent, attr)
                module = QuantLinear(parts, None if old.bias is None else torch.empty_like(old.bias))
                if attr == "lm_head":
                    self._packed_lm_head = module
            setattr(parent, attr, module)
