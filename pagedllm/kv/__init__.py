"""KV cache memory management: the paged manager, the contiguous baseline, their stats."""

from __future__ import annotations

from pagedllm.config import CacheConfig
from pagedllm.kv.contiguous import ContiguousKVManager
from pagedllm.kv.manager import NO_HIT, KVCacheManager, PrefixHit
from pagedllm.kv.stats import KVStats

__all__ = ["NO_HIT", "ContiguousKVManager", "KVCacheManager", "KVStats", "PrefixHit",
           "create_kv_manager"]


def create_kv_manager(cache_config: CacheConfig, max_model_len: int,
                      bytes_per_block: int = 0) -> KVCacheManager | ContiguousKVManager:
    """The manager CacheConfig asks for (kv_layout "paged" or "contiguous")."""
    if cache_config.num_blocks < 1:
        raise ValueError(f"num_blocks must be at least 1; got {cache_config.num_blocks}")
    if cache_config.kv_layout == "contiguous":
        return ContiguousKVManager(cache_config.num_blocks, cache_config.block_size,
                                   max_model_len, reserve=cache_config.contiguous_reserve,
                                   bytes_per_block=bytes_per_block)
    return KVCacheManager(cache_config.num_blocks, cache_config.block_size,
                          enable_prefix_caching=cache_config.enable_prefix_caching,
                          bytes_per_block=bytes_per_block)
