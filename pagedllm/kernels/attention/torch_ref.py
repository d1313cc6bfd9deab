"""Portable paged attention in plain torch: correct everywhere, fast enough on CPU.

Requests with several new tokens (prefill chunks) are handled one at a time, since each needs its
own causal mask offset by the tokens it already has cached. Single-token decodes need no causal
mask, so they are gathered into one padded batch and run as a single attention call: with many
running sequences that saves a Python-level loop per layer.

A compressed cache (kv_quant.QuantizedKV) is quantized on write and its gathered blocks are
dequantized before the attention call, which runs in float32: the attention over exactly the
values the codes stand for, which makes this the kernel's oracle for them too.

Attention sinks (gpt-oss) and soft-capping are written out in float32 (SDPA has a hook for
neither); every other call is one SDPA call.

With a sliding window only the blocks from the window of each request's first new token on are
gathered: the entries before it may be holes (blocks the KV manager gave back) and are never read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.kernels.attention import kv_quant
from pagedllm.kernels.attention.kv_quant import CacheSide, QuantizedKV, gather_blocks
from pagedllm.kernels.attention.metadata import AttentionMetadata
from pagedllm.utils import cdiv


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: CacheSide,
    value_cache: CacheSide,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each new token's K/V [T, Hkv, D] at its physical slot (block * block_size + offset)."""
    for x, cache in ((key, key_cache), (value, value_cache)):
        if isinstance(cache, QuantizedKV):
            kv_quant.write_slots(cache, x, slot_mapping)
        else:
            cache.view(-1, *cache.shape[-2:]).index_copy_(0, slot_mapping, x)


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
    """Attention of each request's new tokens [T, Hq, D] over its whole context in the cache.

    The new K/V must already be written (write_kv), so the context includes them. softcap: the
    scores become softcap * tanh(score / softcap) before the softmax. sinks: [Hq] logits each
    head's softmax adds to its denominator (a column of the scores that has no value).
    """
    if isinstance(key_cache, QuantizedKV) and query.dtype != torch.float32:
        # The values codes stand for are not bf16 / fp16 values: attend in float32 (as the kernel
        # does) rather than round them first.
        return paged_attention(query.float(), key_cache, value_cache, attn_metadata, scale,
                               sliding_window, softcap, sinks).to(query.dtype)
    out = torch.empty_like(query)
    starts = attn_metadata.query_start_loc_cpu
    decodes: list[int] = []
    for b, ctx_len in enumerate(attn_metadata.seq_lens_cpu):
        q_start, q_end = starts[b], starts[b + 1]
        if q_end - q_start == 1:
            decodes.append(b)
        elif q_end > q_start:
            out[q_start:q_end] = _chunk_attention(
                query[q_start:q_end], key_cache, value_cache,
                attn_metadata.block_tables[b], ctx_len, scale, sliding_window, softcap, sinks)
    if decodes:
        rows = torch.tensor([starts[b] for b in decodes], device=query.device)
        out[rows] = _batched_decode_attention(
            query[rows], key_cache, value_cache, attn_metadata, decodes, scale, sliding_window,
            softcap, sinks)
    return out


def _first_key_block(ctx_len: int, q_len: int, sliding_window: int | None, block_size: int) -> int:
    """The first block the new tokens read: the one with the oldest key in the window of the first
    new token, at position ctx_len - q_len (0 without a window)."""
    if sliding_window is None:
        return 0
    return max(0, ctx_len - q_len - sliding_window + 1) // block_size


def _gather_context(cache: CacheSide, block_ids: torch.Tensor, first_block: int, ctx_len: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """One request's tokens from the start of first_block to ctx_len, from its blocks:
    [ctx_len - first_block * block_size, Hkv, D] in dtype."""
    block_size = cache.shape[1]
    blocks = gather_blocks(cache, block_ids[first_block:cdiv(ctx_len, block_size)].long(), dtype)
    return blocks.flatten(0, 1)[:ctx_len - first_block * block_size]


def _chunk_attention(
    query: torch.Tensor,
    key_cache: CacheSide,
    value_cache: CacheSide,
    block_ids: torch.Tensor,
    ctx_len: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Causal attention of q_len new tokens that come after ctx_len - q_len cached ones."""
    q_len = query.shape[0]
    first_block = _first_key_block(ctx_len, q_len, sliding_window, key_cache.shape[1])
    key = _gather_context(key_cache, block_ids, first_block, ctx_len, query.dtype)
    value = _gather_context(value_cache, block_ids, first_block, ctx_len, query.dtype)
    # New token i sits at absolute position ctx_len - q_len + i and sees keys 0..that position.
    # SDPA's is_causal aligns the mask to the top-left corner, which is only right without
    # cached context, so the mask is built explicitly.
    # Without cached context or a window the two agree, and is_causal takes the faster kernel.
    if q_len == ctx_len and sliding_window is None and softcap is None and sinks is None:
        mask, is_causal = None, True
    else:
        key_start = first_block * key_cache.shape[1]
        mask, is_causal = _chunk_mask(q_len, ctx_len, key_start, sliding_window, query.device), False
    # A leading batch dimension of 1: SDPA takes its fast CPU (flash) path only for 4-D inputs
    # (measured 7-12x faster on a 1024-token bf16 chunk than the same call with 3-D tensors).
    out = _attention(
        query.transpose(0, 1).unsqueeze(0), key.transpose(0, 1).unsqueeze(0),
        value.transpose(0, 1).unsqueeze(0), mask, is_causal, scale, softcap, sinks)
    return out.squeeze(0).transpose(0, 1)


def _chunk_mask(
    q_len: int, ctx_len: int, key_start: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """[q_len, ctx_len - key_start] bool: which of the keys from key_start on each new token may
    see."""
    query_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    key_pos = torch.arange(key_start, ctx_len, device=device)[None, :]
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask


def _batched_decode_attention(
    query: torch.Tensor,
    key_cache: CacheSide,
    value_cache: CacheSide,
    attn_metadata: AttentionMetadata,
    decodes: list[int],
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One new token [N, Hq, D] for each of N requests, attending over padded contexts: each
    request's blocks from the first its window reads (0 without a window)."""
    block_size = key_cache.shape[1]
    ctx_lens = [attn_metadata.seq_lens_cpu[b] for b in decodes]
    firsts = [_first_key_block(n, 1, sliding_window, block_size) for n in ctx_lens]
    num_blocks = max(cdiv(n, block_size) - first for n, first in zip(ctx_lens, firsts))
    device = query.device
    table = attn_metadata.block_tables
    first = torch.tensor(firsts, device=device)[:, None]
    columns = (first + torch.arange(num_blocks, device=device)).clamp_(max=table.shape[1] - 1)
    rows = torch.tensor(decodes, device=device)[:, None]
    # Entries past a request's own blocks may hold any filler; clamp so the gather stays in
    # bounds (masked out).
    block_ids = table[rows, columns].long().clamp_(min=0).flatten()
    # index_select on the flat list is several times faster than advanced indexing here.
    padded_shape = (len(decodes), num_blocks * block_size, *key_cache.shape[2:])
    key = gather_blocks(key_cache, block_ids, query.dtype).view(padded_shape)
    value = gather_blocks(value_cache, block_ids, query.dtype).view(padded_shape)
    key_pos = first * block_size + torch.arange(key.shape[1], device=device)[None, :]
    lens = torch.tensor(ctx_lens, device=device)[:, None]
    mask = key_pos < lens
    if sliding_window is not None:
        mask &= key_pos >= lens - sliding_window
    out = _attention(query[:, :, None, :], key.transpose(1, 2), value.transpose(1, 2),
                     mask[:, None, None, :], False, scale, softcap, sinks)
    return out[:, :, 0, :]


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over [B, H, L, D] inputs whose key/value heads each serve a group of query heads.
    SDPA has no hook to soft-cap the scores or to add sinks, so such attention is written out, in
    float32 (a mask is then required)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                              is_causal=is_causal, scale=scale, enable_gqa=True)
    group = query.shape[1] // key.shape[1]
    key = key.float().repeat_interleave(group, dim=1)
    value = value.float().repeat_interleave(group, dim=1)
    scores = query.float() @ key.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return (scores.softmax(dim=-1) @ value).to(query.dtype)
    # The sink is one more column of each head's scores, dropped after the softmax: it takes its
    # share of the denominator and brings no value.
    sink_column = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink_column], dim=-1).softmax(dim=-1)[..., :-1]
    return (probs @ value).to(query.dtype)
