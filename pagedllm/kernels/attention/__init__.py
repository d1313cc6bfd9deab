"""Paged attention behind one pair of functions, so faster kernels can replace the torch one.

The KV cache of one layer is a (key_cache, value_cache) pair. With kv_cache_dtype "auto" each is
a tensor in the model's dtype shaped [num_blocks, block_size, num_kv_heads, head_dim]: one
token's K/V is one contiguous write. A compressed cache (int8, fp8_e4m3, fp8_e5m2) makes each a
kv_quant.QuantizedKV instead:

    data   [num_blocks, block_size, num_kv_heads, head_dim]  int8 / float8_e4m3fn / float8_e5m2
    scale  [num_blocks, block_size, num_kv_heads]            float16

element = data * scale. write_kv quantizes each new token as it stores it (scale = max |x| over
the token's head / the format's largest code, 127, 448 or 57344, rounded to float16; data =
x / scale rounded to the format, half to even); attention reads the codes and dequantizes in its
inner loop. kv_quant holds the formats and the reference code; a new backend reads the same
layout.

paged_attention runs the compiled CPU kernel (cpu_attention: in place through the block table, one
call for prefill chunks and decodes) where it is built and takes the call, the Triton kernel
(triton_attention, the same contract) for CUDA tensors, and the portable torch path (torch_ref, also
the reference both kernels are tested against) everywhere else. The Triton kernel reads compressed
pages and soft-caps in its inner loop, so CUDA takes the torch path only without Triton.

Attention sinks (gpt-oss: a learned logit per query head that joins each softmax's denominator
and adds no value) are in the torch path only: a call with sinks takes it on every device, so the
compiled and Triton kernels, and every other model's results, are untouched. The one-call decode
(model/decode_layers.py) and batch-invariant mode (model/batch_invariant.py), which call the
compiled kernel directly, refuse a model with sinks.
"""

from __future__ import annotations

import logging
import math

import torch

from pagedllm import envs
from pagedllm.kernels.attention import cpu_attention, kv_quant, torch_ref
from pagedllm.kernels.attention.kv_quant import CacheSide, QuantizedKV, kv_format
from pagedllm.kernels.attention.metadata import AttentionMetadata

__all__ = [
    "AttentionMetadata",
    "CacheSide",
    "KVCache",
    "QuantizedKV",
    "allocate_kv_cache",
    "copy_blocks",
    "kv_cache_bytes_per_block",
    "paged_attention",
    "write_kv",
]

KVCache = tuple[CacheSide, CacheSide]

logger = logging.getLogger(__name__)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: CacheSide,
    value_cache: CacheSide,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each new token's K/V [T, Hkv, D] at its physical slot (block * block_size + offset),
    quantized where the cache is compressed."""
    if (cpu_attention.write_kv_supports(key, key_cache)
            and cpu_attention.write_kv_supports(value, value_cache)):
        cpu_attention.write_kv(key, value, key_cache, value_cache, slot_mapping)
    else:
        torch_ref.write_kv(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: CacheSide,
    value_cache: CacheSide,
    attn_metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each request's new tokens [T, Hq, D] over its whole context in the cache
    (the new K/V already written by write_kv): [T, Hq, D]. softcap: scores become
    softcap * tanh(score / softcap) before the softmax (Gemma 2). sinks: [Hq] logits each head's
    softmax counts in its denominator (gpt-oss; the torch path). With
    attn_metadata.batch_invariant, each row's result is independent of the batch (the CPU
    kernel's row-invariant entry; pagedllm.model.batch_invariant checked at start-up that it
    takes this model)."""
    if sinks is not None:
        return torch_ref.paged_attention(query, key_cache, value_cache, attn_metadata, scale,
                                         sliding_window, softcap, sinks)
    if attn_metadata.batch_invariant:
        return cpu_attention.paged_attention(query, key_cache, value_cache, attn_metadata, scale,
                                          sliding_window, softcap, row_invariant=True)
    if cpu_attention.supports(query, key_cache):
        return cpu_attention.paged_attention(query, key_cache, value_cache, attn_metadata, scale,
                                          sliding_window, softcap)
    if query.device.type == "cuda":
        gpu_kernel = _triton_attention()
        if gpu_kernel is not None and gpu_kernel.supports(query, key_cache):
            return gpu_kernel.paged_attention(query, key_cache, value_cache, attn_metadata, scale,
                                              sliding_window, softcap)
    return torch_ref.paged_attention(query, key_cache, value_cache, attn_metadata, scale,
                                     sliding_window, softcap)


_triton_state: dict[str, object] = {}  # "module": the loaded backend, or None where it cannot be


def _triton_attention():
    """The Triton backend, imported on the first CUDA call (CPU-only runs never import Triton);
    None, with one warning, where Triton is not installed or PAGEDLLM_ATTENTION=torch."""
    if "module" not in _triton_state:
        module = None
        if envs.PAGEDLLM_ATTENTION == "torch":
            why = "PAGEDLLM_ATTENTION=torch"
        else:
            try:
                from pagedllm.kernels.attention import triton_attention as module
                why = None
            except ImportError as exc:
                why = f"triton is not importable ({exc})"
        if why:
            logger.warning("Triton attention unavailable, CUDA attention takes the portable torch "
                           "path: %s", why)
        _triton_state["module"] = module
    return _triton_state["module"]


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    return (num_blocks, block_size, num_kv_heads, head_dim)


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    kv_cache_dtype: str = "auto",
    values_share_keys: bool = False,
) -> list[KVCache]:
    """One zeroed (key_cache, value_cache) pair per layer, in the model's dtype (kv_cache_dtype
    "auto") or compressed: views into one allocation (two with scales). values_share_keys: one
    cache per layer, given as both (latent attention reads its one latent as keys and values:
    model/mla.py)."""
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    sides = 1 if values_share_keys else 2
    full_shape = (num_layers, sides, *shape)
    fmt = kv_format(kv_cache_dtype)
    if fmt is None:
        caches = _zeros(full_shape, dtype, device)
        layers = [[caches[layer, side] for side in range(sides)] for layer in range(num_layers)]
    else:
        codes = _zeros(full_shape, fmt.storage, device)
        scales = _zeros(full_shape[:-1], kv_quant.SCALE_DTYPE, device)
        layers = [[QuantizedKV(codes[layer, side], scales[layer, side]) for side in range(sides)]
                  for layer in range(num_layers)]
    return [(parts[0], parts[-1]) for parts in layers]  # one object as both where values share keys


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zeroed tensor. A large CPU allocation is a fresh mapping of the OS's zero pages (glibc
    serves anything over 32 MiB with its own mmap), so it is not written here: the KV budget then
    costs resident memory only as its blocks get used, and no start-up time."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type == "cpu" and nbytes >= _UNWRITTEN_ZEROS_BYTES:
        tensor = torch.empty(shape, dtype=dtype, device=device)
        flat = tensor.view(-1).view(torch.uint8)
        if flat[0] != 0 or flat[-1] != 0:  # not fresh pages after all (reading maps no memory)
            tensor.zero_()
        return tensor
    return torch.zeros(shape, dtype=dtype, device=device)


_UNWRITTEN_ZEROS_BYTES = 48 * 2**20


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    kv_cache_dtype: str = "auto", values_share_keys: bool = False,
) -> int:
    """Bytes one physical block takes across all layers, keys and values together (codes and
    their scales, for a compressed cache; keys alone where values_share_keys)."""
    fmt = kv_format(kv_cache_dtype)
    per_head = head_dim * dtype.itemsize if fmt is None else fmt.bytes_per_head(head_dim)
    return (1 if values_share_keys else 2) * num_layers * block_size * num_kv_heads * per_head


def copy_blocks(kv_caches: list[KVCache], src: list[int], dst: list[int]) -> None:
    """Copy-on-write: physical blocks src[i] -> dst[i] in every layer, codes with their scales."""
    if not src:
        return
    device = kv_caches[0][0].device
    src_ids, dst_ids = torch.tensor(src, device=device), torch.tensor(dst, device=device)
    for keys, values in kv_caches:
        kv_quant.copy_blocks(keys, src_ids, dst_ids)
        if values is not keys:  # latent attention's one cache serves as both
            kv_quant.copy_blocks(values, src_ids, dst_ids)
