"""The batched token bitmask: filled from the matchers of one step, applied to its logits.

A bitmask is int32 [rows, ceil(vocab_size / 32)], bit i of word j set when token 32*j + i is
allowed (llguidance's layout, and xgrammar's and vLLM's). Its width is the tokenizer's vocabulary;
the model's logits may be wider (a padded lm_head: the extra rows are never allowed) or narrower
(tokenizer-only added tokens: their bits are ignored).

Applying, measured on 2 busy cores with SmolLM2's 49,152 tokens (one torch thread, medians of
25-40 interleaved runs, masks with 0.1%, 50% and 95% of the tokens allowed): the bias table used
here (each mask byte indexes 8 ready-made 0/-inf biases, added to the logits a few rows at a time)
costs 0.02 ms for 1 row and 0.4-0.6 ms for 16 whatever the mask; a boolean masked_fill or
torch.where costs as much on a nearly empty mask but up to 20x more on a half-allowed one (11 ms at
16 rows: a branch per token); unpacking with torch shifts is slower again. At 64 rows everything
but one is 2-12 ms here, memory-bound and noisy; the exception is llguidance's own helper, a
torch.compile'd fused kernel, steady at 1.8 ms, which is not used because it compiles with
inductor on first use (seconds, again per dtype) and needs a C++ compiler at run time. A fused C++
kernel beside the others in kernels/csrc would get its speed without that (a follow-up).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch

# The numpy unpacking reads the int32 words as bytes, lowest first.
assert sys.byteorder == "little", "the token bitmask unpacking assumes a little-endian CPU"

_BITS = torch.arange(32, dtype=torch.int32)
# _BYTE_BIAS[b, i] = 0.0 if bit i of byte b is set else -inf: one mask byte's 8 logit biases.
_BYTE_BIAS = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, 0.0, -np.inf).astype(np.float32)
_CHUNK_BYTES = 512 * 1024


def allocate_token_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask of `rows` rows with every token allowed (a row no matcher fills is a no-op).
    Made by numpy: a torch.full this size is a parallel region (see _add_mask_bias)."""
    return torch.from_numpy(np.full((rows, (vocab_size + 31) // 32), -1, dtype=np.int32))


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int,
                         rows: Sequence[int] | None = None) -> None:
    """Set to -inf, in place, the logits of every token its bitmask row does not allow.

    logits: [num_rows, model_vocab]. bitmask: one row per logits row, or, with `rows`, one row
    per listed logits row (bitmask[i] masks logits[rows[i]]; the other rows are left alone).
    vocab_size: the tokenizer's, which the bitmask was filled for.
    """
    if rows is not None:
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        selected = logits.index_select(0, index)
        apply_token_bitmask_(selected, bitmask, vocab_size)
        logits.index_copy_(0, index, selected)
        return
    if bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {logits.shape[0]} rows of logits")
    covered = min(logits.shape[1], vocab_size, bitmask.shape[1] * 32)
    if logits.device.type == "cpu":
        _add_mask_bias(logits[:, :covered], bitmask)
    else:
        allowed = unpack_bitmask_torch(bitmask.to(logits.device, non_blocking=True), covered)
        logits[:, :covered].masked_fill_(~allowed, float("-inf"))
    logits[:, covered:] = float("-inf")


def _add_mask_bias(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits += 0 where allowed, -inf where not, the bias read from a table by mask byte: no
    branch per token, so the cost does not depend on the mask's pattern (a masked_fill costs up
    to 20x more on a half-allowed mask than on a nearly empty one). A few rows at a time, so the
    bias stays in cache, added by numpy for float32 logits: a torch add runs on torch's thread
    pool, and on busy cores each of its parallel regions may wait a time slice for a thread the
    system gave to someone else (64 rows, 2 torch threads, load 5 on 2 cores: 150-260 ms with a
    torch add per chunk, 9-16 ms with numpy's; 1.5-9 ms either way on one thread)."""
    packed = bitmask.contiguous().numpy().view(np.uint8)
    num_rows, num_tokens = logits.shape
    target = logits.numpy() if logits.dtype == torch.float32 else None
    chunk = max(1, _CHUNK_BYTES // (packed.shape[1] * 32)) if target is not None else num_rows
    bias = np.empty((min(chunk, num_rows), packed.shape[1], 8), dtype=np.float32)
    for start in range(0, num_rows, chunk):
        part = packed[start:start + chunk]
        out = bias[:part.shape[0]]
        np.take(_BYTE_BIAS, part, axis=0, out=out)
        flat = out.reshape(part.shape[0], -1)[:, :num_tokens]
        if target is not None:
            rows = target[start:start + chunk]
            np.add(rows, flat, out=rows)
        else:  # another dtype: one torch add for all rows (one parallel region)
            logits.add_(torch.from_numpy(flat))


def unpack_bitmask(bitmask: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """bool [rows, num_tokens], True where allowed (numpy unpacks 8 bits at a time)."""
    packed = bitmask.contiguous().numpy().view(np.uint8)
    bits = np.unpackbits(packed, axis=1, count=num_tokens, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))


def unpack_bitmask_torch(bitmask: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The same with torch ops only, on the bitmask's device (for logits off the CPU)."""
    bits = (bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1
    return bits.view(bitmask.shape[0], -1)[:, :num_tokens].bool()


def allowed_ids(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids one bitmask row allows."""
    bits = unpack_bitmask(bitmask_row.reshape(1, -1), min(vocab_size, bitmask_row.numel() * 32))
    return bits[0].nonzero().flatten().tolist()
