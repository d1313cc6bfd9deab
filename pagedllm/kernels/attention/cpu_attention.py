"""The compiled CPU paged attention (csrc/paged_attention.cpp, from the chosen tier: tiers.py): in
place through the block table, one call for prefill chunks and decodes; the KV writes and the
parallel first touch of new blocks. The same contract as torch_ref, its oracle."""

from __future__ import annotations

import torch

from pagedllm.kernels import compiled, tiers
from pagedllm.kernels.attention.kv_quant import CacheSide, QuantizedKV
from pagedllm.kernels.attention.metadata import AttentionMetadata

_CODE_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)  # compressed caches (kv_quant)
_HEAD_DIMS = (16, 32, 64, 128, 256)  # the sizes compiled in


def _parts(cache: CacheSide) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A cache side as the kernel takes it: its elements (or codes), and their scales or None."""
    if isinstance(cache, QuantizedKV):
        return cache.data, cache.scale
    return cache, None


def _takes_cache(dtype: torch.dtype, cache: CacheSide) -> bool:
    """Whether the kernel reads and writes this cache side next to K/V/queries of dtype: one in
    that dtype, or one compressed next to float32 or bfloat16."""
    if isinstance(cache, QuantizedKV):
        return dtype in compiled.KERNEL_DTYPES and cache.data.dtype in _CODE_DTYPES
    return cache.dtype == dtype


def supports(query: torch.Tensor, key_cache: CacheSide) -> bool:
    """Whether the chosen tier's kernel can run this call (dtype, device, head size)."""
    return (query.device.type == "cpu" and query.dtype in compiled.KERNEL_DTYPES
            and _takes_cache(query.dtype, key_cache)
            and query.shape[-1] in _HEAD_DIMS and query.shape[1] % key_cache.shape[2] == 0
            and tiers.current().has("attention"))


def paged_attention(
    query: torch.Tensor,
    key_cache: CacheSide,
    value_cache: CacheSide,
    attn_metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    use_amx: bool | None = None,
    row_invariant: bool = False,
) -> torch.Tensor:
    """Same contract as torch_ref.paged_attention; call only where supports() is true. use_amx:
    whether bf16 prefill may run on AMX tiles (None: as the chosen tier says: amx, and not
    PAGEDLLM_ATTENTION_AMX=0). row_invariant: each row's result independent of the batch
    (pagedllm.model.batch_invariant; no AMX then)."""
    if query.stride(2) != 1 or query.stride(1) != query.shape[2]:
        query = query.contiguous()
    (key_data, key_scale), (value_data, value_scale) = _parts(key_cache), _parts(value_cache)
    if row_invariant:
        return tiers.current().ops.paged_attention_invariant(
            query, key_data, value_data, key_scale, value_scale, attn_metadata.block_tables,
            attn_metadata.seq_lens, attn_metadata.query_start_loc, scale,
            sliding_window if sliding_window is not None else 0,
            softcap if softcap is not None else 0.0)
    if use_amx is None:
        use_amx = tiers.current().attention_amx
    return tiers.current().ops.paged_attention(
        query, key_data, value_data, key_scale, value_scale, attn_metadata.block_tables,
        attn_metadata.seq_lens, attn_metadata.query_start_loc, scale,
        sliding_window if sliding_window is not None else 0,
        softcap if softcap is not None else 0.0, use_amx)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: CacheSide, value_cache: CacheSide,
             slot_mapping: torch.Tensor) -> None:
    """Same contract as torch_ref.write_kv, for key/value rows that may be strided views."""
    (key_data, key_scale), (value_data, value_scale) = _parts(key_cache), _parts(value_cache)
    tiers.current().ops.write_kv(key, value, key_data, value_data, key_scale, value_scale, slot_mapping)


def write_kv_supports(key: torch.Tensor, key_cache: CacheSide) -> bool:
    return (key.device.type == "cpu" and _takes_cache(key.dtype, key_cache)
            and key.dim() == 3 and key.stride(2) == 1 and key.stride(1) == key.shape[2]
            and tiers.current().has("attention"))


def touch_blocks(kv_caches: list[tuple[CacheSide, CacheSide]], block_ids: torch.Tensor) -> None:
    """Fault every page of these blocks (int64 ids) into the process in one parallel pass, in
    every layer's K/V (and scales), keeping their contents."""
    caches = [part for layer in kv_caches for side in layer for part in _parts(side) if part is not None]
    tiers.current().ops.touch_blocks(caches, block_ids)


def attention_amx_available() -> bool:
    """Whether paged_attention runs bf16 prefill on AMX tiles under the chosen tier."""
    return tiers.current().attention_amx
