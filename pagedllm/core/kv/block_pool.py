"""Physical KV blocks: a free queue with O(1) removal anywhere, ref counts, and the prefix
cache's hash -> block map. Knows nothing about requests.

A block is in exactly one of three states:
  - owned: ref_cnt > 0 (one ref per request holding it);
  - free and cached: ref_cnt == 0, has a hash, sits in the free queue and can be revived;
  - free: ref_cnt == 0, no hash, sits in the free queue.
An owned block holds one kind of page (the model's keys and values, or a recurrent layer's state:
kinds.py); all kinds come from the one free queue and are counted by kind while owned.
Free blocks are taken from the head of the queue. Cached blocks are freed to the tail, so the
head is the least recently used; taking a cached block evicts it (its hash is dropped).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from pagedllm.core.kv.kinds import FULL_ATTENTION


class KVBlock:
    """One physical block. The `cache_*` fields describe what a cached block holds."""

    __slots__ = ("block_id", "ref_cnt", "kind", "num_filled", "block_hash", "cache_tokens",
                 "cache_parent", "cache_parent_epoch", "cache_salt", "cache_epoch",
                 "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.kind: str | None = None  # what an owned (or cached) block holds; None while plain free
        # Slots holding (or about to hold) a token; frozen while the block is shared.
        self.num_filled = 0
        self.block_hash: bytes | None = None
        # What a cached block holds, kept so that a hit is confirmed exactly rather than
        # trusted to the hash: its tokens, and the block before it in the sequence
        # (identified by object and epoch, since blocks get reused) or, for a first block,
        # the cache salt.
        self.cache_tokens: tuple[int, ...] | None = None
        self.cache_parent: KVBlock | None = None
        self.cache_parent_epoch = 0
        self.cache_salt: str | tuple | None = None  # Request.prefix_salt
        # Bumped on every eviction: a child cached under an older epoch of this block
        # was computed from other contents.
        self.cache_epoch = 0
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None

    def __repr__(self) -> str:
        cached = " cached" if self.is_cached else ""
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, filled={self.num_filled}{cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels: every operation is O(1)."""

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("No free blocks available")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVBlock]:
        if n > self.num_free:
            raise ValueError(f"No free blocks available: asked for {n}, {self.num_free} free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, anchor: KVBlock, block: KVBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        block.prev_free = anchor
        block.next_free = anchor.next_free
        anchor.next_free.prev_free = block
        anchor.next_free = block
        self.num_free += 1


class BlockPool:
    """All physical blocks, their ref counts, the free queue and the prefix-hash map.

    It also keeps the count of used slots (the filled slots of owned blocks, each physical
    slot once) so that usage figures cost O(1) whatever the number or length of requests.
    """

    def __init__(self, num_blocks: int, kv_kind: str = FULL_ATTENTION) -> None:
        """kv_kind: what the model keeps in its KV pages (kinds.py), the kind a page takes unless
        told another."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1; got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.kv_kind = kv_kind
        self.free_queue = FreeBlockQueue(self.blocks)
        # hash -> blocks holding it. Usually one; two requests computing the same prefix
        # at once each fill their own copy, and both stay findable.
        self._cached: dict[bytes, list[KVBlock]] = {}
        self.num_cached_free = 0
        self.num_used_slots = 0
        self.num_owned_by_kind: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, cached-but-evictable ones included."""
        return self.free_queue.num_free

    def take(self, n: int, kind: str | None = None) -> list[KVBlock]:
        """n blocks from the head of the free queue, each with one ref, to hold `kind` (None: the
        model's keys and values, kv_kind); evicts cached ones."""
        kind = kind or self.kv_kind
        blocks = self.free_queue.popleft_n(n)
        for block in blocks:
            if block.is_cached:
                self.num_cached_free -= 1
                self._evict(block)
            block.ref_cnt = 1
            block.num_filled = 0
            block.kind = kind
        if blocks:
            self.num_owned_by_kind[kind] = self.num_owned_by_kind.get(kind, 0) + n
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """One more ref each; a free (cached) block is revived out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.num_cached_free -= block.is_cached
                self.num_used_slots += block.num_filled
                self.num_owned_by_kind[block.kind] = self.num_owned_by_kind.get(block.kind, 0) + 1
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """One ref less each, in the given order: the last block to reach zero is the last
        to be evicted among them."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} released more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt:
                continue
            self.num_used_slots -= block.num_filled
            self.num_owned_by_kind[block.kind] -= 1
            if block.is_cached:
                self.num_cached_free += 1
                self.free_queue.append(block)
            else:
                # Nothing worth keeping: reuse it before any cached block.
                block.num_filled = 0
                block.kind = None
                self.free_queue.appendleft(block)

    def fill(self, block: KVBlock, num_filled: int) -> None:
        """Record that an owned block now holds num_filled slots."""
        self.num_used_slots += num_filled - block.num_filled
        block.num_filled = num_filled

    def cache(self, block: KVBlock, block_hash: bytes, tokens: tuple[int, ...],
              parent: KVBlock | None, salt: str | tuple | None) -> None:
        """Register a full, computed block under its hash."""
        block.block_hash = block_hash
        block.cache_tokens = tokens
        block.cache_parent = parent
        block.cache_parent_epoch = parent.cache_epoch if parent is not None else 0
        block.cache_salt = salt if parent is None else None
        self._cached.setdefault(block_hash, []).append(block)

    def cached_blocks(self, block_hash: bytes) -> list[KVBlock]:
        return self._cached.get(block_hash, [])

    @property
    def num_cached_hashes(self) -> int:
        return len(self._cached)

    def _evict(self, block: KVBlock) -> None:
        same_hash = self._cached[block.block_hash]
        same_hash.remove(block)
        if not same_hash:
            del self._cached[block.block_hash]
        block.block_hash = None
        block.cache_tokens = None
        block.cache_parent = None
        block.cache_salt = None
        block.cache_epoch += 1

    def reset_prefix_cache(self) -> bool:
        """Drop every hash. Refused (False) while any block is owned. The blocks that held them
        go to the head of the free queue, as any freed block without a hash does: their memory
        has been written, and blocks never used yet would first cost page faults (on a VM with
        another large process resident, 2 s of CPU over the bench workload)."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            if block.is_cached:
                self._evict(block)
                block.num_filled = 0
                self.free_queue.remove(block)
                self.free_queue.appendleft(block)
        self.num_cached_free = 0
        return True


class PendingCopies:
    """Block copies (src, dst) the runner must do before the next model run.

    Kept free of chains (a copy out of a block that is itself waiting for a copy reads from
    the original source instead) and of two copies into one block, so the runner may do them
    all at once, gathering every source before scattering, and get what doing them in order
    would give.
    """

    def __init__(self) -> None:
        self._src_of: dict[int, int] = {}  # dst -> src, in recording order
        self._last_taken: list[tuple[int, int]] = []  # the copies the current step does

    def __bool__(self) -> bool:
        return bool(self._src_of)

    def add(self, src: int, dst: int) -> None:
        src = self._src_of.get(src, src)
        self._src_of.pop(dst, None)
        if src != dst:
            self._src_of[dst] = src

    def discard_into(self, is_freed: Callable[[int], bool]) -> None:
        """Forget copies into blocks given back before the copy ran: nobody reads them."""
        self._src_of = {dst: src for dst, src in self._src_of.items() if not is_freed(dst)}

    def take(self) -> list[tuple[int, int]]:
        copies = [(src, dst) for dst, src in self._src_of.items()]
        self._src_of = {}
        self._last_taken = copies
        return copies

    def destinations(self) -> list[int]:
        """Blocks being copied into: by the copies the last take() handed out (this step's)
        and by those still pending, for the block map."""
        return [dst for _, dst in self._last_taken] + list(self._src_of)
