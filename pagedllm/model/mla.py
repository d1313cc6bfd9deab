"""Multi-head latent attention (DeepSeek-V2/V3), computed over the compressed cache.

Each token's keys and values are made from one latent c (kv_lora_rank values, normed) and one
rotary key k_r (qk_rope_head_dim values) shared by every head: head h's key is [W_k[h] c, k_r] and
its value W_v[h] c, where kv_b_proj stacks W_k and W_v. The cache stores only [c, k_r] per token,
as a single "KV head" (ModelConfig: num_key_value_heads 1, head_dim kv_lora_rank +
qk_rope_head_dim), so its bytes per token are the latent's, not heads x (key + value).

The attention never expands the cache. W_k is absorbed into the query: q_h . [W_k[h] c, k_r] =
[W_k[h]^T q_nope_h, q_rope_h] . [c, k_r], so each head's query becomes a vector in the latent's
space and the paged attention runs as multi-query attention over [c, k_r] with [c, k_r] as the
values too (one cache tensor read for both); the first kv_lora_rank dimensions of its output are
sum_t p_t c_t, which W_v[h] turns into head h's output. The softmax scale is that of the
uncompressed heads: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5.

DeepSeek lays the rotary dimensions out in interleaved pairs; they are rotated as pairs and
stored halves-first (q and k alike, so their dot products are unchanged).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels.attention import AttentionMetadata, KVCache, paged_attention, write_kv
from pagedllm.model.config import ModelConfig
from pagedllm.model.rope import apply_rotary

# DeepSeek's own norms inside the attention use this epsilon whatever the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, norm: type[nn.Module]):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_lora = config.v_head_dim, config.kv_lora_rank
        self.interleaved = config.rope_interleave
        self.scale = (self.nope + self.rope) ** -0.5
        q_out = self.num_heads * (self.nope + self.rope)
        hidden = config.hidden_size
        if config.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
            self.q_a_layernorm = norm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora + self.rope, bias=False)
        self.kv_a_layernorm = norm(self.kv_lora, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") \
            else self.q_proj(x)
        q_nope, q_rope = q.view(tokens, self.num_heads, -1).split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_rope, k_rope = self._rotate(q_rope, cos, sin), self._rotate(k_rope.view(tokens, 1, -1), cos, sin)
        entry = torch.cat([latent.view(tokens, 1, -1), k_rope], dim=-1)  # what the cache keeps
        key_cache, _ = kv_cache
        write_kv(entry, entry, key_cache, key_cache, attn_metadata.slot_mapping)
        w_k, w_v = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora).split(
            [self.nope, self.v_dim], dim=1)
        q_latent = torch.einsum("thn,hnc->thc", q_nope, w_k)
        query = torch.cat([q_latent, q_rope], dim=-1)
        out = paged_attention(query, key_cache, key_cache, attn_metadata, self.scale)
        heads = torch.einsum("thc,hvc->thv", out[..., :self.kv_lora], w_v)
        return self.o_proj(heads.reshape(tokens, self.num_heads * self.v_dim))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not self.interleaved:
            return apply_rotary(x, cos, sin)
        half = cos.shape[-1] // 2
        cos, sin = cos[:, None, :half], sin[:, None, :half]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
