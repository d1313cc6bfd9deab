"""A compact picture of every KV block, for the dashboard: one state code, one ref count and one
fill count per block, and each request's blocks.

It is plain data (bytes, ints, strings), so that it can cross a process boundary as it is (the
engine core is moving into a process of its own) and be sent to a browser a few times a second:
three bytes per block and a few runs per request, never the cache itself. The managers build it
from their own state (KVCacheManager.block_map, ContiguousKVManager.block_map) with the helpers
below; it is only read, never fed back.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pagedllm.core.kv.block_pool import KVBlock

# One code per block, in the order the page's legend lists them.
FREE, USED, SHARED, CACHED, COPYING = range(5)
STATE_NAMES = ("free", "used", "shared", "cached", "copying")
STATE_DESCRIPTIONS = (
    "free: holds nothing",
    "used: owned by one running request",
    "shared: owned by several requests (ref count > 1)",
    "cached: free, but still holding a prefix the next request can reuse (evictable)",
    "copying: the destination of a copy-on-write done or pending this step",
)
MAX_BYTE = 255  # ref counts saturate here; fill counts fit (block sizes are at most 128)


@dataclass(frozen=True)
class BlockMap:
    block_size: int
    states: bytes  # one code per block (FREE, USED, ...)
    ref_counts: bytes  # owners per block, saturating at 255
    filled: bytes  # slots holding K/V per block (0 for a free block)
    # request id -> the blocks it holds as runs of consecutive block ids: (first block, count)
    owners: dict[str, list[tuple[int, int]]]
    # request id -> the leading entries of its block table it has given back (sliding window:
    # holes no layer reads again); requests with none are left out
    freed: dict[str, int] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return len(self.states)

    def counts(self) -> dict[str, int]:
        """How many blocks are in each state."""
        return {name: self.states.count(code) for code, name in enumerate(STATE_NAMES)}

    def to_dict(self) -> dict:
        """JSON-ready: the per-block bytes in base64 (4 characters per 3 blocks)."""
        def b64(data: bytes) -> str:
            return base64.b64encode(data).decode("ascii")

        return {"block_size": self.block_size, "states": b64(self.states),
                "ref_counts": b64(self.ref_counts), "filled": b64(self.filled),
                "owners": {rid: [list(run) for run in runs] for rid, runs in self.owners.items()},
                "freed": dict(self.freed)}

    @classmethod
    def from_dict(cls, data: dict) -> BlockMap:
        return cls(data["block_size"], base64.b64decode(data["states"]),
                   base64.b64decode(data["ref_counts"]), base64.b64decode(data["filled"]),
                   {rid: [tuple(run) for run in runs] for rid, runs in data["owners"].items()},
                   dict(data.get("freed", {})))


def runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """[5, 6, 7, 10] -> [(5, 3), (10, 1)]: a block table in a few numbers (often one run)."""
    out: list[tuple[int, int]] = []
    start = prev = None
    for block_id in block_ids:
        if prev is not None and block_id == prev + 1:
            prev = block_id
            continue
        if start is not None:
            out.append((start, prev - start + 1))
        start = prev = block_id
    if start is not None:
        out.append((start, prev - start + 1))
    return out


def paged_block_map(blocks: Sequence[KVBlock], block_size: int,
                    tables: Iterable[tuple[str, Sequence[int], int]],
                    copy_destinations: Iterable[int]) -> BlockMap:
    """The picture of a block pool: state from each block's ref count and hash, owners from the
    requests' tables, each given as (request id, the blocks it holds, how many leading entries
    of its table it has given back), copying from the copy-on-write destinations of this step."""
    num_blocks = len(blocks)
    states = bytearray(num_blocks)
    ref_counts = bytearray(num_blocks)
    filled = bytearray(num_blocks)
    for i, block in enumerate(blocks):
        ref = block.ref_cnt
        if ref:
            states[i] = USED if ref == 1 else SHARED
            ref_counts[i] = ref if ref < MAX_BYTE else MAX_BYTE
            filled[i] = block.num_filled
        elif block.block_hash is not None:
            states[i] = CACHED
            filled[i] = block.num_filled
    for block_id in copy_destinations:
        if ref_counts[block_id]:
            states[block_id] = COPYING
    owners, freed = {}, {}
    for request_id, held, num_freed in tables:
        owners[request_id] = runs(held)
        if num_freed:
            freed[request_id] = num_freed
    return BlockMap(block_size, bytes(states), bytes(ref_counts), bytes(filled), owners, freed)


def contiguous_block_map(num_blocks: int, block_size: int,
                         reservations: Iterable[tuple[str, int, int, int]],
                         copy_destinations: Iterable[int]) -> BlockMap:
    """The picture of contiguous reservations, each (request id, first block, number of blocks,
    tokens used): its blocks are used, filled from the front, the rest reserved but empty."""
    states = bytearray(num_blocks)
    ref_counts = bytearray(num_blocks)
    filled = bytearray(num_blocks)
    owners = {}
    for request_id, start, length, used_tokens in reservations:
        end = start + length
        states[start:end] = bytes([USED]) * length
        ref_counts[start:end] = bytes([1]) * length
        full, rest = divmod(min(used_tokens, length * block_size), block_size)
        filled[start:start + full] = bytes([block_size]) * full
        if rest:
            filled[start + full] = rest
        owners[request_id] = [(start, length)]
    for block_id in copy_destinations:
        if ref_counts[block_id]:
            states[block_id] = COPYING
    return BlockMap(block_size, bytes(states), bytes(ref_counts), bytes(filled), owners)
