"""Paged attention in Triton, for CUDA: prefill chunks and decodes of one step in one launch.

The same contract as torch_ref.paged_attention (its oracle) and cpu_attention.paged_attention: the
new tokens' queries [T, Hq, D] of B requests laid end to end attend, causally, over each request's
context read in place through its block table row.

How the work is cut (the shape of vLLM's unified Triton attention): each request's new tokens are
split into query blocks of BLOCK_Q tokens, and one program takes one query block and one KV head.
Its BLOCK_M = BLOCK_Q * (Hq / Hkv) rows are every query head sharing that KV head (GQA) for each of
the BLOCK_Q tokens, so one K/V tile read from the cache serves the whole group in two matmuls. The
program walks the context in tiles of TILE_SIZE keys, looking each key's physical block up in the
table (a tile may span several cache blocks), and keeps an online softmax (running max, running
sum, rescaled accumulator) so nothing of size context is ever materialized. Request b's query
blocks are numbered from query_start_loc[b] // BLOCK_Q + b, an upper bound that needs no prefix sum
on the host: the grid has T // BLOCK_Q + B rows and a program past its request's last block exits.

Everything the launch needs is in tensors already on the device or in their shapes: the launch
reads no value back from the GPU. The kernel is a torch custom op (pagedllm_triton.paged_attention)
with a fake implementation, so the engine's forward pass runs under torch's FakeTensorMode on a
machine without a GPU: tests check there that every tensor of a step is on the device and that no
step reads a value back in the middle of the layers.

Triton's interpreter (TRITON_INTERPRET=1, set before this module is imported) runs the same kernel
on CPU tensors; the op is then registered for CPU too, which is how the tests run it here. The
interpreter keeps bfloat16 as raw 16-bit integers and computes on those bits, so under it bfloat16
tiles are widened to float32 before any arithmetic; on a GPU they go to the tensor cores as they are.

Compressed pages (kv_quant: int8, fp8_e4m3, fp8_e5m2 codes with a float16 scale per token and KV
head) are read as codes and dequantized in the inner loop without ever materializing the values:
a code converts exactly to bfloat16 / float16 (int8's -127..127 and every fp8 value fit both), so
the tiles of codes go to the tensor cores in the query's dtype, and the scales, one per key, are
applied outside the matmuls in float32: to the columns of q.K (scores[:, j] * k_scale[j]) and to
the probabilities before P.V (p[:, j] * v_scale[j]). The torch path dequantizes first and attends
in float32; the two differ by the rounding of p to 16 bits, as the uncompressed kernel's P.V does.

Logit soft-capping (Gemma 2): scores become softcap * tanh(scores / softcap) before the mask and
the softmax, tanh written with one exp (no libdevice call: the same code under the interpreter).
Not done: split-KV for few very long decodes.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from triton import knobs

from pagedllm.kernels.attention.kv_quant import CacheSide, QuantizedKV
from pagedllm.kernels.attention.metadata import AttentionMetadata

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CODE_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)  # compressed caches (kv_quant)
_MAX_HEAD_DIM = 256
_LOG2_E = tl.constexpr(1.4426950408889634)  # the softmax runs on exp2


# Triton reads TRITON_INTERPRET when a kernel is decorated, so the import decides for good.
_INTERPRETED = bool(knobs.runtime.interpret)


def interpreting() -> bool:
    """Whether this module's kernels run on Triton's CPU interpreter (TRITON_INTERPRET=1 when the
    module was imported)."""
    return _INTERPRETED


def supports(query: torch.Tensor, key_cache: CacheSide) -> bool:
    """Whether the kernel can run this call: CUDA tensors (CPU ones under the interpreter), one of
    the float dtypes for the queries and a cache in the same dtype or compressed (int8 / fp8
    codes), a head size up to 256, whole GQA groups."""
    device_ok = query.device.type == "cuda" or (interpreting() and query.device.type == "cpu")
    if isinstance(key_cache, QuantizedKV):
        cache_ok = key_cache.data.dtype in _CODE_DTYPES
    else:
        cache_ok = key_cache.dtype == query.dtype
    return (device_ok and query.dtype in _DTYPES and cache_ok
            and query.shape[-1] <= _MAX_HEAD_DIM and query.shape[1] % key_cache.shape[2] == 0)


def paged_attention(
    query: torch.Tensor,
    key_cache: CacheSide,
    value_cache: CacheSide,
    attn_metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    block_m: int | None = None,
    tile_size: int | None = None,
) -> torch.Tensor:
    """Same contract as torch_ref.paged_attention; call only where supports() is true.
    block_m / tile_size override the launch shape (tests use them to cover both)."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None; got {softcap!r}")
    if block_m is None:
        # Decode-only steps (one new token per request): a 16-row block holds a token's whole GQA
        # group with little padding; a step with prefill chunks fills 64 rows of several tokens.
        block_m = 16 if query.shape[0] == attn_metadata.num_seqs else 64
    group = query.shape[1] // key_cache.shape[2]
    block_m = max(block_m, triton.next_power_of_2(group))
    (key_data, key_scale), (value_data, value_scale) = _parts(key_cache), _parts(value_cache)
    return torch.ops.pagedllm_triton.paged_attention(
        query, key_data, value_data, key_scale, value_scale, attn_metadata.block_tables,
        attn_metadata.seq_lens, attn_metadata.query_start_loc, scale, sliding_window or 0,
        softcap or 0.0, block_m, tile_size or _default_tile_size(key_cache.shape[1], query.shape[-1]))


def _parts(cache: CacheSide) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A cache side as the op takes it: its elements (or codes), and their scales or None."""
    if isinstance(cache, QuantizedKV):
        return cache.data, cache.scale
    return cache, None


def _default_tile_size(block_size: int, head_dim: int) -> int:
    """Keys per inner-loop step: at least 16 (the smallest matmul Triton lowers), larger for
    small heads, where a tile of keys is cheap to hold."""
    return max(16, block_size if head_dim > 128 else max(block_size, 32))


def _launch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            key_scale: torch.Tensor | None, value_scale: torch.Tensor | None,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
            scale: float, sliding_window: int, softcap: float, block_m: int,
            tile_size: int) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    block_q = block_m // group
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("paged attention needs each head's values contiguous (stride 1 along head_dim)")
    compressed = key_scale is not None
    if compressed != (value_scale is not None):
        raise ValueError("paged attention: keys and values must both be compressed, or neither")
    if not compressed:  # never read: the cache itself stands in for the pointer, strides 0
        key_scale = value_scale = key_cache
    scale_strides = (*key_scale.stride()[:3], *value_scale.stride()[:3]) if compressed else (0,) * 6
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    # Triton launches on the current CUDA device, which need not be the tensors' (cuda:1).
    with torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext():
        _unified_attention_kernel[grid](
            out, query, key_cache, value_cache, key_scale, value_scale,
            block_tables, seq_lens, query_start_loc,
            scale, num_seqs, sliding_window, softcap,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            *scale_strides,
            block_tables.stride(0),
            GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
            HEAD_DIM=head_dim, HEAD_DIM_PADDED=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_SIZE=block_size, TILE_SIZE=tile_size, USE_WINDOW=sliding_window > 0,
            USE_SOFTCAP=softcap > 0, COMPRESSED=compressed,
            UPCAST=query.dtype == torch.float32 or (interpreting() and query.dtype == torch.bfloat16),
        )
    return out


def _fake(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
          key_scale: torch.Tensor | None, value_scale: torch.Tensor | None,
          block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
          scale: float, sliding_window: int, softcap: float, block_m: int,
          tile_size: int) -> torch.Tensor:
    """The op's output without running it (FakeTensorMode, meta): shape, dtype, device; it also
    refuses inputs on different devices, which the real launch would only find on a GPU."""
    tensors = {"key_cache": key_cache, "value_cache": value_cache, "key_scale": key_scale,
               "value_scale": value_scale, "block_tables": block_tables, "seq_lens": seq_lens,
               "query_start_loc": query_start_loc}
    misplaced = {name: str(t.device) for name, t in tensors.items()
                 if t is not None and t.device != query.device}
    if misplaced:
        raise RuntimeError(f"paged attention inputs must all be on the query's device "
                           f"{query.device}; found {misplaced}")
    return torch.empty_like(query)


_LIBRARY = torch.library.Library("pagedllm_triton", "DEF")
_LIBRARY.define(
    "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor? key_scale, "
    "Tensor? value_scale, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
    "float scale, int sliding_window, float softcap, int block_m, int tile_size) -> Tensor")
_LIBRARY.impl("paged_attention", _launch, "CUDA")
if interpreting():
    _LIBRARY.impl("paged_attention", _launch, "CPU")
torch.library.register_fake("pagedllm_triton::paged_attention", _fake, lib=_LIBRARY)


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The request whose query blocks include q_block: the last b whose first block
    (query_start_loc[b] // BLOCK_Q + b) is at or before it. Binary search."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _soft_cap(scores, softcap):
    """softcap * tanh(scores / softcap), tanh(|x|) as (1 - e) / (1 + e) with e = exp(-2|x|) in
    (0, 1]: nothing overflows, and it saturates to 1 where e underflows."""
    x = scores / softcap
    e = tl.exp(-2.0 * tl.abs(x))
    magnitude = (1.0 - e) / (1.0 + e)
    return softcap * tl.where(x < 0, -magnitude, magnitude)


@triton.jit
def _unified_attention_kernel(
    out_ptr, query_ptr, key_cache_ptr, value_cache_ptr,
    key_scale_ptr, value_scale_ptr,  # compressed caches: float16 [blocks, slots, kv heads]
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale,  # the softmax scale
    num_seqs, sliding_window, softcap,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_ks_block, stride_ks_slot, stride_ks_head,
    stride_vs_block, stride_vs_slot, stride_vs_head,
    stride_table_row,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # tokens per program
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q * GROUP, rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE_SIZE: tl.constexpr,  # keys per inner-loop step
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    COMPRESSED: tl.constexpr,  # the caches hold codes, with a scale per token and KV head
    UPCAST: tl.constexpr,  # matmuls in float32 (IEEE, never TF32)
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_request(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens cached before this step's

    rows = tl.arange(0, BLOCK_M)
    token = local_block * BLOCK_Q + rows // GROUP  # index among the request's new tokens
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (token < q_len)
    query_pos = context_len + token  # absolute position: sees keys 0..query_pos
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM

    q = tl.load(query_ptr + (q_start + token)[:, None] * stride_q_token
                + head[:, None] * stride_q_head + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    # Without a soft cap the softmax runs on exp2, the scale folded with log2(e) into one multiply;
    # with one, the cap needs the scores in natural units first.
    if USE_SOFTCAP:
        score_scale = scale
    else:
        score_scale = scale * _LOG2_E

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of each row's scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp(score - max)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)

    # Keys this block's queries can see: up to its last token's position, and with a sliding
    # window none before its first token's window. The table entries of blocks before that may be
    # holes (the KV manager gave them back), so a tile starting earlier does not load them.
    key_end = tl.minimum(context_len + (local_block + 1) * BLOCK_Q, seq_len)
    key_first = 0
    if USE_WINDOW:
        key_first = tl.maximum(context_len + local_block * BLOCK_Q - sliding_window + 1, 0)
    table_row = block_tables_ptr + seq * stride_table_row
    for tile_start in range(key_first // TILE_SIZE * TILE_SIZE, key_end, TILE_SIZE):
        key_pos = tile_start + tl.arange(0, TILE_SIZE)
        key_valid = (key_pos >= key_first) & (key_pos < key_end)
        block_ids = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slots = key_pos % BLOCK_SIZE
        k = tl.load(key_cache_ptr + block_ids[None, :] * stride_k_block + slots[None, :] * stride_k_slot
                    + kv_head * stride_k_head + dims[:, None],
                    mask=dim_valid[:, None] & key_valid[None, :], other=0.0)  # [D, TILE]
        v = tl.load(value_cache_ptr + block_ids[:, None] * stride_v_block + slots[:, None] * stride_v_slot
                    + kv_head * stride_v_head + dims[None, :],
                    mask=key_valid[:, None] & dim_valid[None, :], other=0.0)  # [TILE, D]
        if UPCAST:
            scores = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            scores = tl.dot(q, k.to(q.dtype))  # codes convert exactly; plain K is already q's dtype
        if COMPRESSED:
            k_scale = tl.load(key_scale_ptr + block_ids * stride_ks_block + slots * stride_ks_slot
                              + kv_head * stride_ks_head, mask=key_valid, other=0.0).to(tl.float32)
            scores = scores * k_scale[None, :]
        scores = scores * score_scale
        if USE_SOFTCAP:
            scores = _soft_cap(scores, softcap) * _LOG2_E
        visible = key_valid[None, :] & (key_pos[None, :] <= query_pos[:, None])
        if USE_WINDOW:
            visible = visible & (key_pos[None, :] > query_pos[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row with nothing visible yet keeps max -inf; subtracting 0 instead avoids -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if COMPRESSED:  # p.(codes * scale) as (p * scale).codes: the scale is per key, a column of p
            v_scale = tl.load(value_scale_ptr + block_ids * stride_vs_block + slots * stride_vs_slot
                              + kv_head * stride_vs_head, mask=key_valid, other=0.0).to(tl.float32)
            weights = p * v_scale[None, :]
        else:
            weights = p
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(weights, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(weights.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + token)[:, None] * stride_o_token + head[:, None] * stride_o_head
             + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & dim_valid[None, :])
