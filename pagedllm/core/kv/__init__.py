"""KV cache memory management: the paged manager, the contiguous baseline, their stats."""

from __future__ import annotations

from pagedllm.core.kv.contiguous import ContiguousKVManager
from pagedllm.core.kv.manager import NO_HIT, KVCacheManager, PrefixHit
from pagedllm.core.kv.stats import KVStats

__all__ = ["NO_HIT", "ContiguousKVManager", "KVCacheManager", "KVStats", "PrefixHit"]
