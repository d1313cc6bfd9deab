"""Decode steps through every decoder layer in one compiled call (csrc/decode_layers.cpp).

A decode step of one stream on a small model is bound by Python, not by the CPU: each layer makes
some ten module calls, checks and views around its kernels, about as long as its matmuls take.
Where a model is Llama-shaped with weights kept quantized (the GGUF case: Llama, Mistral, Qwen2,
SmolLM ...) and the chosen tier compiles the families it runs (tiers.LAYER_FAMILIES: avx2
and up), DecodeLayers packs each layer's tensors once
into two flat lists, and a step of a few rows runs all layers and the final norm in one call of
the same kernels in the same order as LlamaForCausalLM's layers: the results are bit for bit
theirs (tested), the Python between kernels gone.

Which models qualify (`DecodeLayers.build`; anything else keeps the layer-by-layer path): every
layer a plain DecoderLayer (no latent attention, no sandwich norms, no attention sinks: the
compiled attention has none), rotary in place over whole heads (after Qwen3's q/k norms, which the
layer and the call both apply in place by the compiled RMSNorm), SiLU, no local rope; the MLP
gated, or a mixture of such experts routed greedily by softmax, with no shared expert (Qwen3-MoE,
Mixtral) or a gated one (Qwen2-MoE): the compiled router, then model/moe.py's operations in the
same order, each expert and the shared one by the compiled kernels, the shared expert's gate by the
same torch operations (DeepSeek's ungated shared experts come with latent attention, which keeps
the layers' path anyway); every projection QuantLinear as loaded (or wrapped for LoRA on the CPU,
whose updates csrc/lora.cpp adds in the same call; not wrapped for tensor parallelism, not
batch-invariant); the KV caches of the model's dtype or compressed.
Which steps: up to as many rows as QuantLinear gives its few-rows kernel (max_kernel_rows: so each
matmul is the one the layers would run), and not batch-invariant ones. Where the weights are
row-interleaved for the int8 kernel, which takes any chunk (quant_linear.interleaved_kernel_rows),
that is prefill chunks too.

A decode burst (engine/decode_burst.py) runs in one call too (`DecodeLayers.burst`,
csrc/decode_burst.cpp) where its Python loop (worker/runner.py's run_burst) would make only calls
the burst call makes in C++: the embedding table one lookup (quantized or plain, no scale, no
adapters), the rotary embedding's frequencies the same at every step of the burst (no length
past which its rope type changes them), and the greedy head one QuantLinear argmax call
(`_burst_parts` and `bursts` say which). Its tokens are the loop's, bit for bit (tested).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import torch

from pagedllm.kernels import tiers
from pagedllm.kernels.attention import AttentionMetadata, KVCache, QuantizedKV
from pagedllm.lora.layers import LoRALinear, LoRAState
from pagedllm.model.quant_linear import MAX_KERNEL_ROWS_BEFORE_AMX, QuantEmbedding, QuantLinear
from pagedllm.model.rope import RotaryEmbedding

_NONE = torch.empty(0)  # an absent tensor in the flat list
_NO_SLOTS = torch.empty(0, dtype=torch.int64)  # no projection wrapped for LoRA


@dataclass(frozen=True)
class BurstSpeculation:
    """n-gram speculation inside a burst in one call (spec_decode/ngram.py's rule, compiled): each
    sequence's tokens so far (prompt and output, ending with its first id) as int64, and how many
    tokens each of its steps may propose."""
    histories: list[torch.Tensor]
    ks: list[int]
    lookup_min: int
    lookup_max: int

    def within(self, max_rows: int) -> BurstSpeculation:
        """The same with the largest ks cut until a step's rows (each sequence's token and its
        proposal) fit in max_rows."""
        ks = list(self.ks)
        while sum(ks) + len(ks) > max_rows and max(ks) > 0:
            ks[ks.index(max(ks))] -= 1
        return replace(self, ks=ks)


@dataclass(frozen=True)
class BurstParts:
    """What a burst in one call takes beside the layers: the embedding table ([weight], or a
    quantized one's [codes, scales, mins, codebook] and bits, group size: 0, 0 for a plain one),
    the LM head (its argmax is the call's), and the rotary embedding whose cos/sin the call
    computes as rope.py does."""
    embedding: list[torch.Tensor]
    embedding_bits: int
    embedding_group_size: int
    head: QuantLinear
    rotary: RotaryEmbedding
    dtype: torch.dtype


class DecodeLayers:
    def __init__(self, tensors: list[torch.Tensor], meta: list[int], kv_caches: list[KVCache],
                 max_rows: int, eps: float, scale: float, softcap: float, use_amx: bool,
                 lora_state: LoRAState | None = None):
        self.tensors, self.meta = tensors, meta
        self.lora_state = lora_state
        self.kv_caches = kv_caches  # the caches packed in: a step with others takes the layers' path
        self.max_rows = max_rows
        self.eps, self.scale, self.softcap, self.use_amx = eps, scale, softcap, use_amx
        self.op = tiers.current().ops.decode_layers
        self.burst_parts: BurstParts | None = None  # set by build where a burst qualifies

    @classmethod
    def build(cls, model: torch.nn.Module, kv_caches: list[KVCache]) -> DecodeLayers | None:
        """The packed layers of model over kv_caches, or None where the model or tier does not
        qualify (the module docstring says which)."""
        from pagedllm.model.llama import Attention, DecoderLayer, LlamaForCausalLM, RMSNorm

        if not tiers.current().decode_layers or type(model) is not LlamaForCausalLM:
            return None
        config = model.config
        layers = list(model.layers)
        if (model.vocab_gather is not None or config.hidden_act != "silu" or not layers
                or len(kv_caches) != len(layers)
                or any(type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention
                       for layer in layers)):
            return None
        first = layers[0].self_attn
        lora_state = None  # the wrapped projections' LoRAState, where LoRA wraps them
        tensors: list[torch.Tensor] = []
        meta = [len(layers), first.num_heads, first.num_kv_heads, first.head_dim]
        dtype = model.norm.weight.dtype
        projections: list = []  # every projection packed, experts' included
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            attn = layer.self_attn
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            qk_norms = _qk_norms(attn, model, dtype)
            mlp = _mlp_parts(layer.mlp)
            if (layer.attn_output_norm is not None or layer.uses_local_rope
                    or attn.sinks is not None  # the compiled attention has no sinks
                    or not attn.rotary_in_place or (attn.q_norm is not None and not qk_norms)
                    or (attn.scale, attn.softcap) != (first.scale, first.softcap)
                    or any(type(n) is not RMSNorm or n.weight.dtype != dtype or n.eps != model.norm.eps
                           for n in norms)
                    or mlp is None):
                return None
            mlp_meta, mlp_tensors, mlp_projections = mlp
            layer_projections = [attn.qkv_proj, attn.o_proj, *mlp_projections]
            if not all(_qualifies(p) for p in layer_projections):
                return None
            lora_state = next((p.state for p in layer_projections if isinstance(p, LoRALinear)), lora_state)
            caches = _cache_tensors(kv_cache, dtype)
            if caches is None:
                return None
            meta += [attn.sliding_window or 0, int(bool(qk_norms)), *mlp_meta]
            tensors += [norms[0].weight, norms[1].weight, *caches, *qk_norms]
            for projection in layer_projections[:2]:
                _pack_projection(projection, tensors, meta)
            tensors += mlp_tensors
            for projection in layer_projections[2:]:
                _pack_projection(projection, tensors, meta)
            projections += layer_projections
        if type(model.norm) is not RMSNorm or model.norm.weight.dtype != dtype:
            return None
        tensors.append(model.norm.weight)  # the final norm, after the layers
        bases = [_base(p) for p in projections]
        # Above these rows a bf16 QuantLinear takes the AMX kernel, or dequantized tiles (the
        # layers' path then runs).
        amx = any(p.amx_kernel for p in bases)
        max_rows = (MAX_KERNEL_ROWS_BEFORE_AMX if amx and dtype == torch.bfloat16 else
                    min(p.max_kernel_rows for p in bases))
        packed = cls(tensors, meta, kv_caches, max_rows, model.norm.eps, first.scale,
                     first.softcap or 0.0, tiers.current().attention_amx, lora_state)
        packed.burst_parts = _burst_parts(model, dtype)
        return packed

    def takes(self, x: torch.Tensor, kv_caches: list[KVCache], attn_metadata: AttentionMetadata) -> bool:
        """Whether this step runs here: up to max_rows rows, over the caches packed in, not
        batch-invariant."""
        return (x.shape[0] <= self.max_rows and kv_caches is self.kv_caches
                and not attn_metadata.batch_invariant)

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Every layer and the final norm over the embeddings x [T, hidden]: the hidden states,
        as the layers' loop and the model's norm give them."""
        return self.op(
            x.contiguous(), self.tensors, self.meta, cos.contiguous(), sin.contiguous(),
            attn_metadata.slot_mapping, attn_metadata.block_tables, attn_metadata.seq_lens,
            attn_metadata.query_start_loc, self.eps, self.scale, self.softcap, self.use_amx,
            self._lora_slots(x.shape[0]))

    def bursts(self, model: torch.nn.Module, kv_caches: list[KVCache],
               attn_metadata: AttentionMetadata) -> bool:
        """Whether a burst over this prepared step (a row per sequence and step) runs in one call:
        the burst qualifies, its sequences fit the few-rows kernels, its rotary frequencies stay
        those of its first step, and nothing set since the build (adapters) adds to its calls."""
        parts = self.burst_parts
        num_seqs = attn_metadata.num_seqs
        return (parts is not None and kv_caches is self.kv_caches and not attn_metadata.batch_invariant
                and num_seqs <= self.max_burst_rows
                and (parts.rotary.length_limit is None
                     or attn_metadata.max_seq_len <= parts.rotary.length_limit)
                and model.lora_embedding is None and model.lora_head is None)

    def burst(self, first_ids: torch.Tensor, counts: list[int], context: list[int],
              attn_metadata: AttentionMetadata, speculation: BurstSpeculation | None = None,
              max_steps: int = 0) -> tuple[list[list[int]], list[tuple[int, int, int]]]:
        """A burst in one call (where `bursts` says so): each sequence's greedy tokens, made by
        decode steps from its first_ids[i] at position context[i] into the slots of attn_metadata's
        rows, up to counts[i] of them or max_steps steps (0: no limit); with speculation, each
        step verifies the n-gram rule's proposal (its ks within max_burst_rows). Also, with
        speculation, each step of each sequence as (sequence, tokens proposed, proposed kept)."""
        parts = self.burst_parts
        head = parts.head
        codes, scales, mins, codebook, bits, group_size = head.parts[0].kernel_args
        bias = head._float_bias()
        spec = speculation or BurstSpeculation([], [], 1, 1)
        tokens, steps = tiers.current().ops.decode_burst.default(
            first_ids, counts, context, attn_metadata.slot_mapping, attn_metadata.block_tables,
            parts.rotary.inv_freq, float(parts.rotary.attention_factor), self.tensors, self.meta, self.eps,
            self.scale, self.softcap, self.use_amx, parts.embedding, parts.embedding_bits,
            parts.embedding_group_size, [codes, scales, _or_none(mins), _or_none(codebook), _or_none(bias)],
            bits, group_size, parts.dtype, spec.histories, spec.ks, spec.lookup_min, spec.lookup_max,
            max_steps)
        made = [[t for t in row if t >= 0] for row in tokens.tolist()]
        return made, [tuple(step) for step in steps.tolist()]

    @cached_property
    def max_burst_rows(self) -> int:
        """The most rows one step of a burst in one call may run (its sequences' and their
        proposals'): those of the layers' few-rows kernels and of the head's argmax in one call
        (which takes any number up to a bound). Fixed once the burst qualifies."""
        parts = self.burst_parts
        rows = min(self.max_rows, parts.head.max_kernel_rows)  # above it never one call
        while rows > 1 and not parts.head.argmax_in_one_call(rows, parts.dtype):
            rows -= 1
        return rows

    def _lora_slots(self, tokens: int) -> torch.Tensor:
        """Each token's adapter slot (-1: none) for the wrapped projections (none: empty)."""
        if self.lora_state is None:
            return _NO_SLOTS
        slots = self.lora_state.token_slots
        if slots is None or slots.shape[0] != tokens:  # no batch set: the base alone
            return torch.full((tokens,), -1, dtype=torch.int64)
        return slots


def _or_none(tensor: torch.Tensor | None) -> torch.Tensor:
    return _NONE if tensor is None else tensor


def _burst_parts(model, dtype: torch.dtype) -> BurstParts | None:
    """A burst's parts where each of its steps, as run_burst's loop runs it, makes only the calls
    the burst call makes: the embeddings one lookup, unscaled (LlamaForCausalLM.embed), one rotary
    embedding, and the greedy tokens one quantized head's argmax, uncapped (greedy_tokens)."""
    head = getattr(model, "_packed_lm_head", None)
    table = model.embed_tokens
    if (model.embed_scale is not None or model.local_rotary is not None or not isinstance(head, QuantLinear)
            or model.config.final_logit_softcapping is not None):
        return None
    if type(table) is QuantEmbedding and table.in_one_call and table.dtype == dtype:
        codes, scales, mins, codebook, bits, group_size = table.weight_q.kernel_args
        embedding = [codes, scales, _or_none(mins), _or_none(codebook)]
    elif type(table) is torch.nn.Embedding and table.weight.dtype == dtype:
        embedding, bits, group_size = [table.weight], 0, 0
    else:
        return None
    return BurstParts(embedding, bits, group_size, head, model.rotary, dtype)


def _qk_norms(attn, model, dtype: torch.dtype) -> list[torch.Tensor]:
    """The q and k norms' weights of an attention that normalizes each head before rotating it
    over the whole head (Qwen3), as the kernel takes them; [] for any other attention."""
    norms = (attn.q_norm, attn.k_norm)
    if attn.q_norm is None or model.config.rotary_dim != attn.head_dim or any(
            n.weight.dtype != dtype or n.eps != model.norm.eps for n in norms):
        return []
    return [n.weight for n in norms]


def _mlp_parts(mlp) -> tuple[list[int], list[torch.Tensor], list] | None:
    """(meta, tensors before its projections, its projections) of a layer's MLP as the kernel takes
    it: a gated SiLU MLP, or a mixture of such experts with greedy softmax routing and no shared
    expert (Qwen3-MoE, Mixtral) or a gated one (Qwen2-MoE); None for any other."""
    from pagedllm.model.moe import Router, SparseMoE

    if isinstance(mlp, SparseMoE):
        gated = mlp.shared_expert_gate is not None
        experts = list(mlp.experts) + ([mlp.shared_experts] if gated else [])
        # The call routes with the compiled router: only where the layer does too (route_kernel).
        if (mlp.route_kernel is None or (mlp.shared_experts is not None and not gated)
                or (gated and type(mlp.shared_expert_gate) is not Router)
                or not all(getattr(e, "silu_kernel", False) for e in experts)):
            return None
        routing = mlp.routing
        scale = torch.tensor([float(routing["scale"])], dtype=torch.float64)
        shared_gate = [mlp.shared_expert_gate.weight] if gated else []
        return ([mlp.num_experts, mlp.top_k, int(bool(routing["normalize"])), int(gated)],
                [mlp.gate.weight, scale, *shared_gate],
                [p for e in experts for p in (e.gate_up_proj, e.down_proj)])
    if not getattr(mlp, "silu_kernel", False):
        return None
    return [0], [], [mlp.gate_up_proj, mlp.down_proj]


def _cache_tensors(kv_cache: KVCache, dtype: torch.dtype) -> list[torch.Tensor] | None:
    """A layer's (key cache, value cache, key scales, value scales) as the kernel takes them."""
    key, value = kv_cache
    if isinstance(key, QuantizedKV) and isinstance(value, QuantizedKV):
        return [key.data, value.data, key.scale, value.scale]
    if isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor) and key.dtype == dtype:
        return [key, value, _NONE, _NONE]
    return None


def _base(projection) -> QuantLinear:
    """The quantized projection itself, under its LoRA wrapper if it has one."""
    return projection.base if isinstance(projection, LoRALinear) else projection


def _qualifies(projection) -> bool:
    """A QuantLinear as loaded on the CPU kernels, alone or wrapped for LoRA on the CPU (the
    compiled kernel adds its updates), not batch-invariant."""
    if isinstance(projection, LoRALinear) and projection.kernel is None:
        return False
    base = _base(projection)
    return type(base) is QuantLinear and base.cpu_kernel and not base.row_invariant


def _pack_projection(projection, tensors: list[torch.Tensor], meta: list[int]) -> None:
    linear = _base(projection)
    lora = projection if isinstance(projection, LoRALinear) else None
    bias = linear._float_bias()
    meta += [int(bias is not None), int(lora is not None), len(linear.parts)]
    if bias is not None:
        tensors.append(bias)
    if lora is not None:
        tensors += [lora.lora_a, lora.lora_b, lora.part_cols]
    for part in linear.parts:
        codes, scales, mins, codebook, bits, group_size = part.kernel_args
        meta += [bits, group_size, part.shape[0]]
        tensors += [codes, scales, _or_none(mins), _or_none(codebook)]
