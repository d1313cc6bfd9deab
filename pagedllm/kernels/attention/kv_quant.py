"""Compressed KV caches: int8 and fp8 pages, quantized on write and read back inside attention.

One side (keys or values) of a layer's compressed cache is a QuantizedKV: `data` holds one code
per element in the cache's usual shape [num_blocks, block_size, num_kv_heads, head_dim], and
`scale` one float16 per token and kv head, [num_blocks, block_size, num_kv_heads]:
element = code * scale. The scales sit beside the codes block by block, so a block is still the
unit of allocation, sharing, copy-on-write and prefix caching.

Every format quantizes a token's head the same way: scale = max |x| / max_code, rounded up to
a float16 (never down, so no code overflows, and never to 0 unless the head is 0: tiny heads
keep their digits), and code = x / scale (the scale as stored) rounded to the format:
round-half-even to an integer for int8 (max_code 127), to the nearest fp8 value for fp8_e4m3
(448) and fp8_e5m2 (57344). Each token is quantized by itself, so a request's cache never
depends on what else was in the batch.

Measured on the default model in bfloat16 (docs/benchmarks-notebook.md, KV cache dtypes):
- The scale is float16, not float32: perplexity +0.42% over auto's with float16 scales, +0.29%
  with float32 ones, a difference inside the measurement's own noise (about 0.3%), for fewer
  bytes, which is the point: at head_dim 64 a token's head takes 66 bytes against bf16's 128
  (1.94x the tokens; with float32 scales 1.88x, under the 1.9x asked for).
- fp8 keeps a scale too: without one, perplexity rose more over auto's (e4m3 +1.6% instead of
  +1.4%, e5m2 +5.4% instead of +3.6%): with it, a head's largest element, which dominates its
  dot products, lands on the format's largest value, and small heads stay out of the
  subnormals. The 2 bytes per token and head cost 3% of the tokens.
- 4-bit codes (int4, a float16 scale per group of 16 or 32 elements) raised perplexity 11-20%:
  not offered.

This module is the reference (plain torch); the CPU kernel (csrc/paged_attention.cpp) reads and
writes the same layout and codes bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.config import canonical_kv_cache_dtype

SCALE_DTYPE = torch.float16


@dataclass(frozen=True)
class KVFormat:
    """How one kv_cache_dtype stores an element."""

    name: str
    storage: torch.dtype  # of the codes
    max_code: float  # the largest magnitude a code holds

    def bytes_per_head(self, head_dim: int) -> int:
        """Bytes of one token's head: its codes and its scale."""
        return head_dim * self.storage.itemsize + SCALE_DTYPE.itemsize


FORMATS = {
    "int8": KVFormat("int8", torch.int8, 127.0),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 57344.0),
}


def kv_format(kv_cache_dtype: str) -> KVFormat | None:
    """The format a kv_cache_dtype names; None for "auto" (the model's dtype, uncompressed)."""
    name = canonical_kv_cache_dtype(kv_cache_dtype)
    return None if name == "auto" else FORMATS[name]


def stored_dtype_name(kv_cache_dtype: str, dtype: torch.dtype) -> str:
    """What a cache of kv_cache_dtype holds next to a model in dtype, as figures report it:
    the model's dtype for "auto" ("bfloat16"), else the format ("int8", "fp8_e4m3")."""
    fmt = kv_format(kv_cache_dtype)
    return str(dtype).removeprefix("torch.") if fmt is None else fmt.name


@dataclass(frozen=True)
class QuantizedKV:
    """One side of a layer's compressed cache (see the module docstring)."""

    data: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim] codes
    scale: torch.Tensor  # [num_blocks, block_size, num_kv_heads] float16

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def format(self) -> KVFormat:
        return next(f for f in FORMATS.values() if f.storage == self.data.dtype)

    @classmethod
    def from_values(cls, values: torch.Tensor, kv_cache_dtype: str) -> QuantizedKV:
        """A compressed copy of a whole cache side [..., head_dim] (benches and tests)."""
        fmt = kv_format(kv_cache_dtype)
        if fmt is None:
            raise ValueError("kv_cache_dtype 'auto' stores plain tensors, not a QuantizedKV")
        return cls(*quantize(values, fmt))


CacheSide = torch.Tensor | QuantizedKV  # a layer's keys or its values, plain or compressed


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [..., D] in fmt.storage and float16 scales [...] of x [..., D]."""
    x = x.float()
    exact = x.abs().amax(-1) / fmt.max_code
    scale = exact.to(SCALE_DTYPE)
    scale = torch.where(scale.float() < exact, scale.nextafter(torch.tensor(torch.inf, dtype=SCALE_DTYPE)),
                        scale)
    # The codes are computed with the scale as stored, so code * stored scale is what was meant.
    s = scale.float().unsqueeze(-1)
    codes = torch.where(s > 0, x / s, 0.0)
    if not fmt.storage.is_floating_point:
        codes = codes.round_()  # half to even; the cast to fp8 rounds by itself
    # x / s can only pass max_code by the division's own rounding: the clamp keeps the code finite.
    return codes.clamp_(-fmt.max_code, fmt.max_code).to(fmt.storage), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values codes [..., D] times scale [...] stand for, in dtype."""
    return (codes.float() * scale.float().unsqueeze(-1)).to(dtype)


def write_slots(cache: QuantizedKV, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize each token's x [T, Hkv, D] into its physical slot (block * block_size + offset)."""
    codes, scale = quantize(x, cache.format)
    num_kv_heads, head_dim = cache.shape[-2:]
    # index_copy_ takes no float8 tensors: the codes are copied as bytes.
    cache.data.view(torch.uint8).view(-1, num_kv_heads, head_dim).index_copy_(
        0, slot_mapping, codes.view(torch.uint8))
    cache.scale.view(-1, num_kv_heads).index_copy_(0, slot_mapping, scale)


def gather_blocks(cache: CacheSide, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks block_ids of one cache side [N, block_size, Hkv, D], read back in dtype."""
    if isinstance(cache, QuantizedKV):
        return dequantize(cache.data.index_select(0, block_ids), cache.scale.index_select(0, block_ids),
                          dtype)
    return cache.index_select(0, block_ids)


def copy_blocks(cache: CacheSide, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy blocks src to dst (codes and scales together): copy-on-write."""
    for tensor in [cache.data, cache.scale] if isinstance(cache, QuantizedKV) else [cache]:
        tensor[dst] = tensor[src]
