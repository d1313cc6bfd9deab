"""Rotary position embeddings: the cos/sin of each token of a step, and every rope scaling type
the supported families use (default, linear, Llama 3.1, dynamic NTK, YaRN, Phi-3's LongRoPE),
written as transformers writes them so the floats agree bit for bit."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.kernels.attention import AttentionMetadata
from pagedllm.model.config import ModelConfig


def default_inv_freq(base: float | torch.Tensor, dim: int) -> torch.Tensor:
    """1 / base^(2i/dim): written exactly as transformers does, so the floats agree bit for bit."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    if isinstance(base, torch.Tensor):
        return 1.0 / (base[:, None] ** exponents[None, :])
    return 1.0 / (base**exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: slow the low frequencies by `factor`, keep the high ones, blend in between."""
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def longrope_inv_freq(base: float, dim: int, factors: list[float]) -> torch.Tensor:
    """Phi-3's LongRoPE: each frequency divided by its own factor (as transformers writes it)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * base**exponents)


def longrope_attention_factor(config: ModelConfig, scaling: dict) -> float:
    """How much LongRoPE scales cos and sin: from the context it was stretched by, unless given."""
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0


def yarn_inv_freq(base: float, dim: int, scaling: dict) -> torch.Tensor:
    """YaRN: the frequencies that turn fewer than beta_slow times over the original context are
    interpolated (divided by `factor`), those that turn more than beta_fast times kept, and a
    linear ramp over the dimensions between blends the two (as transformers writes it)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension_turning(num_rotations: float) -> float:
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_turning(beta_fast), dimension_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    return 1.0 / (factor * pos_freqs) * (1 - kept) + 1.0 / pos_freqs * kept


def yarn_attention_factor(config: ModelConfig, scaling: dict) -> float:
    """How much YaRN scales cos and sin: 0.1 ln(factor) + 1 unless given (DeepSeek's mscale and
    mscale_all_dim give it as a ratio of two such terms)."""
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    factor = scaling["factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
    return mscale(factor)


def dynamic_ntk_inv_freq(rope: RotaryEmbedding, seq_lens: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK: past the trained length, stretch the base by the request's length."""
    limit, dim, factor = rope.length_limit, rope.dim, rope.scaling["factor"]
    seq_lens = torch.maximum(seq_lens, torch.tensor(limit))
    base = rope.theta * ((factor * seq_lens / limit) - (factor - 1)) ** (dim / (dim - 2))
    return default_inv_freq(base, dim).to(rope.inv_freq.device)


def longrope_long_inv_freq(rope: RotaryEmbedding, seq_lens: torch.Tensor) -> torch.Tensor:
    """LongRoPE: the long factors for the requests past the original length."""
    device = rope.inv_freq.device
    long = longrope_inv_freq(rope.theta, rope.dim, rope.scaling["long_factor"]).to(device)
    return torch.where((seq_lens > rope.length_limit)[:, None].to(device), long, rope.inv_freq)


@dataclass(frozen=True)
class RopeType:
    """What a rope scaling type does: its frequencies at load (from base, rotary dim, scaling), the
    factor on cos and sin, and, for types that change past a length, that length and the
    frequencies of each token of the requests past it (given each token's request length)."""

    inv_freq: Callable[[float, int, dict | None], torch.Tensor]
    attention_factor: Callable[[ModelConfig, dict], float] = lambda config, scaling: 1.0
    length_limit: Callable[[ModelConfig, dict], int] | None = None
    inv_freq_past_limit: Callable[[RotaryEmbedding, torch.Tensor], torch.Tensor] | None = None


# The one table of rope types (config.SUPPORTED_ROPE_TYPES names the same ones).
ROPE_TYPES = {
    "default": RopeType(lambda base, dim, scaling: default_inv_freq(base, dim)),
    "linear": RopeType(lambda base, dim, scaling: default_inv_freq(base, dim) / scaling["factor"]),
    "llama3": RopeType(lambda base, dim, scaling: llama3_inv_freq(default_inv_freq(base, dim),
                                                                  scaling)),
    "dynamic": RopeType(lambda base, dim, scaling: default_inv_freq(base, dim),
                        length_limit=lambda config, scaling: config.max_position_embeddings,
                        inv_freq_past_limit=dynamic_ntk_inv_freq),
    "yarn": RopeType(yarn_inv_freq, attention_factor=yarn_attention_factor),
    "longrope": RopeType(
        lambda base, dim, scaling: longrope_inv_freq(base, dim, scaling["short_factor"]),
        attention_factor=longrope_attention_factor,
        length_limit=lambda config, scaling: scaling["original_max_position_embeddings"],
        inv_freq_past_limit=longrope_long_inv_freq),
}


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the tokens of one step, computed on the fly (cheap next to the matmuls,
    and no table sized by the longest context the model allows).

    local=True: the sliding-window layers' own rope (Gemma 3), its own base and no scaling."""

    def __init__(self, config: ModelConfig, local: bool = False):
        super().__init__()
        self.scaling = None if local else config.rope_scaling
        self.theta = config.local_rope_theta if local else config.rope_theta
        self.dim = config.rotary_dim
        self.rope = ROPE_TYPES["default" if local else config.rope_type]
        self.attention_factor = self.rope.attention_factor(config, self.scaling)
        self.length_limit = (self.rope.length_limit(config, self.scaling)
                             if self.rope.length_limit else None)
        self.register_buffer("inv_freq", self.rope.inv_freq(self.theta, self.dim, self.scaling),
                             persistent=False)

    def forward(
        self, positions: torch.Tensor, attn_metadata: AttentionMetadata, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self._inv_freq(attn_metadata)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def _inv_freq(self, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """The frequencies of this step: [dim / 2], or [T, dim / 2] once a request is past the
        length where its rope type changes them. transformers uses the length of the sequence
        being computed; here each request gets its own, so a request's output does not depend on
        what else is in the batch."""
        if self.length_limit is None or attn_metadata.max_seq_len <= self.length_limit:
            return self.inv_freq
        return self.rope.inv_freq_past_limit(self, _seq_len_of_each_token(attn_metadata))


def _seq_len_of_each_token(attn_metadata: AttentionMetadata) -> torch.Tensor:
    """[T] int64: the context length of each token's request after this step."""
    starts = attn_metadata.query_start_loc_cpu
    new_tokens = torch.tensor([starts[i + 1] - starts[i] for i in range(len(starts) - 1)])
    seq_lens = torch.tensor(attn_metadata.seq_lens_cpu, dtype=torch.int64)
    return seq_lens.repeat_interleave(new_tokens)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, R] for the first R <= D dimensions of each head (partial
    rotary: the others pass through unchanged)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotated = apply_rotary(x[..., :rotary_dim], cos, sin)
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x * cos) + (rotate_half(x) * sin)
