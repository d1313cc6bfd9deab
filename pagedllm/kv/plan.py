"""KV memory planning: how many blocks the budget buys, whether a max_model_len request fits,
the start-up line that says so, and the KV manager the layout asks for.

No torch: the bytes one block takes (every layer's keys and values) come from the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from pagedllm.config import EngineConfig, parse_size
from pagedllm.kv.contiguous import ContiguousKVManager
from pagedllm.kv.manager import KVCacheManager
from pagedllm.utils import cdiv

# With no budget given: a share of the RAM free at start-up, capped.
DEFAULT_KV_SHARE_OF_FREE_RAM = 0.2
DEFAULT_KV_CAP_BYTES = 4 * 2**30
# On a GPU: this share of the device memory still free once the weights are loaded (the rest is
# for activations, the sampler and other processes).
DEFAULT_KV_SHARE_OF_FREE_GPU = 0.5


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    block_size: int  # tokens
    bytes_per_block: int
    max_model_len: int

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


def plan_kv_cache(config: EngineConfig, bytes_per_block: int, max_model_len: int,
                  free_device_bytes: int | None = None) -> KVPlan:
    """The blocks config's budget buys; ValueError if one max_model_len request cannot fit.
    free_device_bytes: a GPU's free memory (None on the CPU), for the default budget."""
    budget = _budget_bytes(config, bytes_per_block, free_device_bytes)
    plan = KVPlan(budget // bytes_per_block, config.block_size, bytes_per_block, max_model_len)
    blocks_per_request = cdiv(max_model_len, plan.block_size)
    if plan.num_blocks < blocks_per_request:
        raise ValueError(
            f"max_model_len={max_model_len} needs {blocks_per_request} blocks of "
            f"{plan.block_size} tokens ({blocks_per_request * bytes_per_block} bytes), but "
            f"kv_cache_memory={budget} bytes holds only {plan.num_blocks} blocks "
            f"({plan.num_slots} tokens): raise kv_cache_memory or lower max_model_len")
    return plan


def _budget_bytes(config: EngineConfig, bytes_per_block: int, free_device_bytes: int | None) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks * bytes_per_block
    if config.kv_cache_memory is not None:
        return parse_size(config.kv_cache_memory)
    if free_device_bytes is not None:
        return int(DEFAULT_KV_SHARE_OF_FREE_GPU * free_device_bytes)
    free = psutil.virtual_memory().available
    return int(min(DEFAULT_KV_CAP_BYTES, DEFAULT_KV_SHARE_OF_FREE_RAM * free))


def make_kv_manager(config: EngineConfig, plan: KVPlan) -> KVCacheManager | ContiguousKVManager:
    """The manager config's kv_layout asks for, over the planned blocks."""
    if config.kv_layout == "contiguous":
        return ContiguousKVManager(plan.num_blocks, plan.block_size, plan.max_model_len,
                                   reserve=config.contiguous_reserve,
                                   bytes_per_block=plan.bytes_per_block)
    return KVCacheManager(plan.num_blocks, plan.block_size,
                          enable_prefix_caching=config.enable_prefix_caching,
                          bytes_per_block=plan.bytes_per_block)


def describe_plan(plan: KVPlan, kv_dtype_name: str, kv_layout: str) -> str:
    """The start-up log line: what the cache holds and how many long requests fit at once."""
    return (f"KV cache: {plan.num_blocks} blocks x {plan.block_size} tokens, "
            f"{plan.bytes_per_block} bytes per block, {plan.num_slots} token slots "
            f"({plan.kv_cache_bytes / 2**20:.1f} MiB, KV dtype {kv_dtype_name}, {kv_layout} layout); "
            f"max_model_len={plan.max_model_len} fits {plan.num_slots // plan.max_model_len} "
            "requests at once")
