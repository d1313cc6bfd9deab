"""Memory figures of a KV cache manager, measured from its state rather than assumed."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class KVStats:
    num_blocks: int
    num_free_blocks: int  # cached-but-evictable blocks included
    block_size: int
    allocated_slots: int  # slots of every block in use (or reserved, for contiguous)
    used_slots: int  # slots holding a token the running requests hold or compute this step
    bytes_per_block: int = 0
    num_cached_free_blocks: int = 0  # free, but still holding a prefix that can be hit
    prefix_cache_queries: int = 0  # tokens of the new requests looked up
    prefix_cache_hits: int = 0  # of those, tokens served from the cache
    # Blocks in use by what they hold (core/kv/kinds.py), for every kind the pool holds: the
    # model's KV pages under its kind's name, and a hybrid model's recurrent state pages.
    pages_by_kind: dict[str, int] = field(default_factory=dict)
    state_pages_per_request: int = 0  # a hybrid model's: each running request holds this many

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def waste_slots(self) -> int:
        return self.allocated_slots - self.used_slots

    @property
    def waste_pct(self) -> float:
        return 100.0 * self.waste_slots / self.allocated_slots if self.allocated_slots else 0.0

    @property
    def allocated_bytes(self) -> int:
        return self._bytes(self.allocated_slots)

    @property
    def used_bytes(self) -> int:
        return self._bytes(self.used_slots)

    @property
    def waste_bytes(self) -> int:
        return self.allocated_bytes - self.used_bytes

    @property
    def bytes_per_token(self) -> int:
        """One token's KV across every attention layer (a latent-attention model's latent; a
        hybrid model's recurrent layers hold none: their state is per request)."""
        return self.bytes_per_block // self.block_size if self.block_size else 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        queries = self.prefix_cache_queries
        return self.prefix_cache_hits / queries if queries else 0.0

    def _bytes(self, slots: int) -> int:
        return slots * self.bytes_per_block // self.block_size

    def to_dict(self) -> dict:
        derived = ("num_used_blocks", "usage", "waste_slots", "waste_pct", "allocated_bytes",
                   "used_bytes", "waste_bytes", "bytes_per_token", "prefix_cache_hit_rate")
        return {**asdict(self), **{name: getattr(self, name) for name in derived}}
