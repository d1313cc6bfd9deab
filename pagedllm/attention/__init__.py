"""Paged attention behind one pair of functions, so faster kernels can replace the torch one.

The KV cache of one layer is a (key_cache, value_cache) pair, each shaped
[num_blocks, block_size, num_kv_heads, head_dim]: one token's K/V is one contiguous write.

paged_attention runs the compiled CPU kernel (cpu_kernel: in place through the block table, one
call for prefill chunks and decodes) where it is built and takes the call, the Triton kernel
(triton_attention, the same contract) for CUDA tensors, and the portable torch path (torch_ref, also
the reference both kernels are tested against) everywhere else.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from pagedllm.attention import cpu_kernel, torch_ref
from pagedllm.attention.metadata import AttentionMetadata

__all__ = [
    "AttentionMetadata",
    "allocate_kv_cache",
    "kv_cache_bytes_per_block",
    "paged_attention",
    "write_kv",
]

logger = logging.getLogger(__name__)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each new token's K/V [T, Hkv, D] at its physical slot (block * block_size + offset)."""
    if cpu_kernel.write_kv_supports(key, key_cache) and cpu_kernel.write_kv_supports(value, value_cache):
        cpu_kernel.write_kv(key, value, key_cache, value_cache, slot_mapping)
    else:
        torch_ref.write_kv(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of each request's new tokens [T, Hq, D] over its whole context in the cache
    (the new K/V already written by write_kv): [T, Hq, D]. softcap: scores become
    softcap * tanh(score / softcap) before the softmax (Gemma 2)."""
    if cpu_kernel.supports(query, key_cache):
        return cpu_kernel.paged_attention(query, key_cache, value_cache, attn_metadata, scale,
                                          sliding_window, softcap)
    if query.device.type == "cuda" and softcap is None:
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
        if os.environ.get("PAGEDLLM_ATTENTION", "auto") == "torch":
            why = "PAGEDLLM_ATTENTION=torch"
        else:
            try:
                from pagedllm.attention import triton_attention as module
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
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One zeroed (key_cache, value_cache) pair per layer: views into one allocation.

    A large CPU allocation is a fresh mapping of the OS's zero pages (glibc serves anything over
    32 MiB with its own mmap), so it is not written here: the KV budget then costs resident memory
    only as its blocks get used, and no start-up time.
    """
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    full_shape = (num_layers, 2, *shape)
    nbytes = math.prod(full_shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type == "cpu" and nbytes >= _UNWRITTEN_ZEROS_BYTES:
        caches = torch.empty(full_shape, dtype=dtype, device=device)
        flat = caches.view(-1)
        if flat[0] != 0 or flat[-1] != 0:  # not fresh pages after all (reading maps no memory)
            caches.zero_()
    else:
        caches = torch.zeros(full_shape, dtype=dtype, device=device)
    return [(caches[layer, 0], caches[layer, 1]) for layer in range(num_layers)]


_UNWRITTEN_ZEROS_BYTES = 48 * 2**20


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one physical block takes across all layers, keys and values together."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size
