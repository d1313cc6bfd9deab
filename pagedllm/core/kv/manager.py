"""Paged KV cache manager: per-request block tables over the block pool, copy-on-write for
forked requests, and prefix caching.

The manager owns block state only; request state (computed tokens, hashes a fork inherits)
belongs to the scheduler, which reads what the manager returns and sets it.

How a prefix-cache hit reaches the runner: the scheduler calls find_cached_prefix() for a
request it is about to admit and passes the result to allocate_slots(), which puts the hit
blocks at the start of the request's table; the scheduler then sets
request.num_computed_tokens to the hit length. The runner sees nothing special: the
request's ScheduledRequest starts at num_computed_tokens > 0 on its first step, its block
table already holds the cached K/V for positions [0, num_computed_tokens), and only the
remaining tokens are fed to the model.

A block enters the prefix cache when the request owning it has *computed* it (its
num_computed_tokens covers the whole block, i.e. from the step after it was written), so
no request ever reads K/V that is being written in the same step.

Speculative decoding: a speculating request's step writes K/V for its proposed tokens too;
allocate_slots takes them like any new tokens (num_new_tokens = 1 + k for a decode), with
copy-on-write for any shared block in the range, so a proposal never lands in a block another
request reads. After verification the scheduler counts only accepted tokens as computed and calls
trim(), which gives back the blocks that hold nothing but rejected tokens and cuts the tail
block's fill to what was kept. Prefix-cache hashes cover request.token_ids, which only ever holds
accepted tokens, and only blocks that num_computed_tokens (accepted K/V) covers whole: a block
with a rejected token in it is never cached; its rejected slots are written over by the next step
before anything reads them.

Sliding windows: when every layer of the model attends only to the last `sliding_window`
keys, a block wholly before the window of a request's next token is read by nothing again,
so allocate_slots gives it back as the request advances (it stays in the prefix cache, if
cached, until evicted). The request's table keeps its logical positions: a freed entry is a
hole, NULL_BLOCK in `ids`, always at the front of the table, and attention never reads it
(every backend starts reading at the window). A request thus holds at most
ceil(window / block_size) + 1 blocks while it decodes, however long it runs.

Recurrent states (hybrid models: model/recurrent_state.py): with state_pages_per_request = k,
a request also holds k pages of kind RECURRENT_STATE from the same pool, taken with its first
blocks and given back with them. They are never shared: a fork takes k pages of its own and the
parent's are copied into them before the next step (the same pending copies as copy-on-write).
A state cannot be rolled back, so such a manager refuses trim() (speculative decoding), and has
no prefix cache (the state at a cached prefix's end is not kept).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.kv.block_pool import BlockPool, KVBlock, PendingCopies
from pagedllm.core.kv.kinds import FULL_ATTENTION, RECURRENT_STATE
from pagedllm.core.kv.prefix_hash import extend_block_hashes
from pagedllm.core.kv.snapshot import BlockMap, paged_block_map
from pagedllm.core.kv.stats import KVStats
from pagedllm.core.request import Request
from pagedllm.utils import cdiv

# A hole in a block table: the entry of a block given back because it fell out of the window.
NULL_BLOCK = -1
# What max_tokens_per_request() says when a window keeps any length within the cache.
UNBOUNDED = 2**62


def peak_blocks(num_tokens: int, block_size: int, sliding_window: int | None,
                max_chunk_tokens: int) -> int:
    """The most blocks one request of num_tokens tokens holds at once, computed in steps of at
    most max_chunk_tokens new tokens. Without a window, all of them. With one, a step from
    position s to e - 1 holds the blocks from the one of s - window + 1 to the one of e - 1,
    a span of chunk + window - 2 positions: at most ceil(span / block_size) + 1 blocks (reached
    when the span starts on a block's last slot). Decodes hold ceil((window - 1) / block_size)
    + 1 <= ceil(window / block_size) + 1."""
    whole = cdiv(num_tokens, block_size)
    if sliding_window is None:
        return whole
    chunk = min(max_chunk_tokens, num_tokens)
    return min(whole, cdiv(chunk + sliding_window - 2, block_size) + 1)


def window_step_cap(num_blocks: int, block_size: int, sliding_window: int | None) -> int | None:
    """The most new tokens one request may take in a step on a windowed layout and still run
    alone in num_blocks (peak_blocks' bound solved for the chunk): a request then holds its window
    plus one step's tokens, never its length. None without a window, or when even one decode
    does not fit (the plan refuses that)."""
    if sliding_window is None:
        return None
    cap = (num_blocks - 1) * block_size - sliding_window + 2
    return cap if cap >= 1 else None


@dataclass(frozen=True)
class PrefixHit:
    """The longest cached prefix of a new request: full blocks, fewer than all its tokens."""

    num_tokens: int = 0
    blocks: tuple[KVBlock, ...] = ()
    # Each block's cache epoch at lookup: a hit used after one of them was evicted is stale.
    epochs: tuple[int, ...] = ()

    def is_stale(self) -> bool:
        return any(b.cache_epoch != e or not b.is_cached for b, e in zip(self.blocks, self.epochs))


NO_HIT = PrefixHit()


@dataclass(eq=False)
class _BlockTable:
    blocks: list[KVBlock | None]  # None: a hole (given back, out of the window)
    # The list the runner reads; kept beside `blocks` so block_ids() is never rebuilt.
    ids: list[int] = field(init=False)
    num_cached: int = 0  # leading blocks already registered in the prefix cache
    num_freed: int = 0  # leading entries given back: blocks[:num_freed] are holes
    state: list[KVBlock] = field(default_factory=list)  # the request's recurrent state pages

    def __post_init__(self) -> None:
        self.ids = [NULL_BLOCK if b is None else b.block_id for b in self.blocks]

    @property
    def held(self) -> list[KVBlock]:
        """The blocks the request holds, in order (every entry after the holes)."""
        return self.blocks[self.num_freed:]

    def extend(self, blocks: list[KVBlock]) -> None:
        self.blocks.extend(blocks)
        self.ids.extend(b.block_id for b in blocks)

    def replace(self, index: int, block: KVBlock | None) -> None:
        self.blocks[index] = block
        self.ids[index] = NULL_BLOCK if block is None else block.block_id

    def truncate(self, num_blocks: int) -> list[KVBlock]:
        """Drop the entries from num_blocks on; the blocks they held."""
        dropped = self.blocks[num_blocks:]
        del self.blocks[num_blocks:]
        del self.ids[num_blocks:]
        return dropped


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 bytes_per_block: int = 0, sliding_window: int | None = None,
                 state_pages_per_request: int = 0, kv_kind: str = FULL_ATTENTION) -> None:
        """sliding_window: keys further back than this are read by no layer of the model
        (ModelConfig.kv_window), so their blocks are given back as requests advance.
        state_pages_per_request: pages of recurrent state each request holds besides its blocks
        (a hybrid model's). kv_kind: what the KV pages hold (kinds.py), for the figures."""
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer; got {block_size!r}")
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer or None; got {sliding_window!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.sliding_window = sliding_window
        if state_pages_per_request and enable_prefix_caching:
            raise ValueError("prefix caching needs the recurrent state at a cached prefix's end, "
                             "which is not kept: turn one of them off")
        self.enable_prefix_caching = enable_prefix_caching
        self.bytes_per_block = bytes_per_block
        self.state_pages_per_request = state_pages_per_request
        self.pool = BlockPool(num_blocks, kv_kind)
        # What one request's keys and values may take when it runs alone: all but its state pages.
        self._kv_blocks_alone = num_blocks - state_pages_per_request
        # With a window, the scheduler gives one request at most this many new tokens a step, so
        # a request of any length runs alone in the cache (None: no limit of the cache's).
        self.max_step_tokens = window_step_cap(self._kv_blocks_alone, block_size, sliding_window)
        self._tables: dict[str, _BlockTable] = {}
        self._pending_copies = PendingCopies()
        self._prefix_queries = 0
        self._prefix_hits = 0

    def max_tokens_per_request(self, max_chunk_tokens: int) -> int:
        """The longest request that can run alone in the whole cache, computed in steps of at
        most max_chunk_tokens new tokens (UNBOUNDED where a window keeps any length within it)."""
        whole = self._kv_blocks_alone * self.block_size
        if self.sliding_window is None:
            return whole
        chunk = min(max_chunk_tokens, self.max_step_tokens or max_chunk_tokens)
        fits_any_length = peak_blocks(UNBOUNDED, self.block_size, self.sliding_window,
                                      chunk) <= self._kv_blocks_alone
        return UNBOUNDED if fits_any_length else whole

    # -- prefix cache lookups -------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> PrefixHit:
        """The longest cached prefix a new request can reuse. No side effects: pass the
        result to allocate_slots() right away (a hit gone stale by then is refused)."""
        if not self.enable_prefix_caching or request.num_computed_tokens or \
                request.request_id in self._tables:
            return NO_HIT
        # At least one token must be computed (it yields the logits), so a prompt made of
        # whole cached blocks still recomputes its last block.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = extend_block_hashes(request.block_hashes, request.token_ids, self.block_size,
                                     max_blocks, request.cache_salt, request.lora_key)
        path = self._longest_cached_path(request, hashes[:max_blocks])
        return PrefixHit(len(path) * self.block_size, tuple(path),
                         tuple(b.cache_epoch for b in path))

    def _longest_cached_path(self, request: Request, hashes: list[bytes]) -> list[KVBlock]:
        # Level by level, every cached block that holds exactly this request's tokens and
        # continues a block matched at the level before: comparing contents (not just
        # hashes) makes a hash collision a miss instead of someone else's K/V.
        frontier: list[KVBlock] = []
        bs = self.block_size
        for i, block_hash in enumerate(hashes):
            tokens = tuple(request.token_ids[i * bs:(i + 1) * bs])
            matched = [b for b in self.pool.cached_blocks(block_hash)
                       if b.cache_tokens == tokens and self._continues(b, frontier, request)]
            if not matched:
                break
            frontier = matched
        if not frontier:
            return []
        path = [frontier[0]]
        while path[-1].cache_parent is not None:
            path.append(path[-1].cache_parent)
        path.reverse()
        return path

    @staticmethod
    def _continues(block: KVBlock, frontier: list[KVBlock], request: Request) -> bool:
        parent = block.cache_parent
        if not frontier:
            return parent is None and block.cache_salt == request.prefix_salt
        return (parent is not None and parent.cache_epoch == block.cache_parent_epoch
                and any(parent is f for f in frontier))

    # -- allocation -------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       prefix_hit: PrefixHit | None = None) -> bool:
        """Make room for request.num_computed_tokens + num_new_tokens tokens (for a new
        request with a prefix_hit: hit tokens + num_new_tokens; the caller then counts the
        hit tokens as computed). All or nothing: False leaves everything unchanged."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0; got {num_new_tokens}")
        table = self._tables.get(request.request_id)
        if table is None:
            return self._allocate_first(request, num_new_tokens, prefix_hit or NO_HIT)
        bs = self.block_size
        start = request.num_computed_tokens
        end = start + num_new_tokens
        if self.enable_prefix_caching and start // bs > table.num_cached:
            self._cache_computed_blocks(request, table)
        if self.sliding_window is not None:
            # Whatever happens next, nothing reads these blocks again: give them back first.
            self._free_out_of_window(table, start)
        blocks = table.blocks
        tail = blocks[-1] if blocks else None
        tail_start = (len(blocks) - 1) * bs
        if (tail is not None and tail_start <= start and end <= tail_start + bs
                and tail.ref_cnt == 1):
            # The usual decode: the new tokens fit in the request's own tail block.
            if end - tail_start > tail.num_filled:
                self.pool.fill(tail, end - tail_start)
            return True
        shared = self._shared_blocks_written(table, start, end)
        num_new_blocks = max(0, cdiv(end, bs) - len(table.blocks))
        if num_new_blocks + len(shared) > self.pool.num_free_blocks:
            return False
        for index in shared:
            self._copy_on_write(table, index)
        table.extend(self.pool.take(num_new_blocks))
        self._fill(table, start, end)
        return True

    def _allocate_first(self, request: Request, num_new_tokens: int, hit: PrefixHit) -> bool:
        if request.num_computed_tokens and not hit.blocks:
            raise ValueError(f"request {request.request_id} has computed tokens but no blocks")
        if hit.blocks and (request.num_computed_tokens or hit.is_stale()):
            raise ValueError(f"stale prefix hit for request {request.request_id}")
        start = hit.num_tokens
        end = start + num_new_tokens
        num_new_blocks = max(0, cdiv(end, self.block_size) - len(hit.blocks))
        # Hit blocks before the window of the first new token are not needed: holes from the start.
        num_holes = min(self._first_needed_block(start), len(hit.blocks))
        needed = hit.blocks[num_holes:]
        # Reviving a free hit block uses up a free block as surely as taking a new one.
        num_revived = sum(1 for b in needed if b.ref_cnt == 0)
        num_state = self.state_pages_per_request
        if num_new_blocks + num_revived + num_state > self.pool.num_free_blocks:
            return False
        # Revive the hits before taking new blocks, so taking cannot evict them.
        self.pool.touch(needed)
        table = _BlockTable([None] * num_holes + list(needed), num_cached=len(hit.blocks),
                            num_freed=num_holes)
        table.extend(self.pool.take(num_new_blocks))
        table.state = self._take_state_pages(num_state)
        self._tables[request.request_id] = table
        self._fill(table, start, end)
        if self.enable_prefix_caching:
            self._prefix_queries += request.num_tokens
            self._prefix_hits += start
        return True

    def _first_needed_block(self, start: int) -> int:
        """The first block a step starting at position `start` reads: the one holding the
        oldest key in its first token's window (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, start - self.sliding_window + 1) // self.block_size

    def _free_out_of_window(self, table: _BlockTable, start: int) -> None:
        """Give back the blocks before the window of position `start`, leaving holes."""
        first_needed = min(self._first_needed_block(start), len(table.blocks))
        if first_needed <= table.num_freed:
            return
        freed = table.blocks[table.num_freed:first_needed]
        for i in range(table.num_freed, first_needed):
            table.replace(i, None)
        table.num_freed = first_needed
        self.pool.release(freed)
        if self._pending_copies:
            self._pending_copies.discard_into(lambda dst: not self.pool.blocks[dst].ref_cnt)

    def _shared_blocks_written(self, table: _BlockTable, start: int, end: int) -> list[int]:
        last = min(len(table.blocks), cdiv(end, self.block_size))
        return [i for i in range(start // self.block_size, last) if table.blocks[i].ref_cnt > 1]

    def _copy_on_write(self, table: _BlockTable, index: int) -> None:
        src = table.blocks[index]
        (dst,) = self.pool.take(1)
        self.pool.fill(dst, src.num_filled)
        self.pool.release([src])
        table.replace(index, dst)
        self._pending_copies.add(src.block_id, dst.block_id)

    def _fill(self, table: _BlockTable, start: int, end: int) -> None:
        bs = self.block_size
        for i in range(start // bs, cdiv(end, bs)):
            block = table.blocks[i]
            filled = min(bs, end - i * bs)
            if filled > block.num_filled:
                self.pool.fill(block, filled)

    def _cache_computed_blocks(self, request: Request, table: _BlockTable) -> None:
        """Register the request's full blocks whose K/V has been computed."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(table.blocks))
        if num_full <= table.num_cached:
            return
        hashes = extend_block_hashes(request.block_hashes, request.token_ids, self.block_size,
                                     num_full, request.cache_salt, request.lora_key)
        bs = self.block_size
        for i in range(table.num_cached, num_full):
            block = table.blocks[i]
            parent = table.blocks[i - 1] if i else None
            if block is None or (i and parent is None):
                # Its parent was given back (a window no wider than a block frees a block before
                # the next is computed): a cached block must name its parent, so the request's
                # chain in the cache ends here.
                return
            if not block.is_cached:  # hit or shared blocks are registered already
                tokens = tuple(request.token_ids[i * bs:(i + 1) * bs])
                self.pool.cache(block, hashes[i], tokens, parent, request.prefix_salt)
            table.num_cached = i + 1

    def trim(self, request: Request, num_kept_tokens: int) -> int | None:
        """Keep the slots of the request's first num_kept_tokens positions, give back the rest:
        after a speculative step, the slots of rejected tokens. A block holding only rejected
        tokens goes back to the pool (at its head: nothing in it is worth caching, and the next
        step takes the same block again); the block of the last kept token stays, its fill cut to
        what is kept. Call after the step ran (its block copies done), with at least the tokens
        the request counts as computed: computed K/V, cached blocks among it, is never cut.
        Returns the blocks the request's list keeps where blocks went back (a copy of the list
        must rewrite it from there: another request may take them first), else None."""
        table = self._tables.get(request.request_id)
        if table is None:
            raise ValueError(f"cannot trim {request.request_id}: it holds no blocks")
        if table.state:
            raise ValueError(f"cannot trim {request.request_id}: a recurrent state cannot be rolled back")
        bs = self.block_size
        capacity = len(table.blocks) * bs
        if not max(1, request.num_computed_tokens) <= num_kept_tokens <= capacity:
            raise ValueError(f"cannot trim {request.request_id} to {num_kept_tokens} tokens: it has "
                             f"{request.num_computed_tokens} computed and slots for {capacity}")
        num_kept_blocks = cdiv(num_kept_tokens, bs)
        dropped = table.truncate(num_kept_blocks)
        if dropped:
            # Last first: released blocks go to the head of the free queue, so the first dropped
            # ends up first in line.
            self.pool.release(reversed(dropped))
            if self._pending_copies:
                self._pending_copies.discard_into(lambda dst: not self.pool.blocks[dst].ref_cnt)
        tail = table.blocks[-1]
        kept_in_tail = num_kept_tokens - (num_kept_blocks - 1) * bs
        if kept_in_tail < tail.num_filled:
            if tail.ref_cnt > 1:  # a step wrote past what is shared: copy-on-write was skipped
                raise ValueError(f"cannot trim {request.request_id}: its block {tail.block_id} is "
                                 f"shared and filled past {num_kept_tokens} tokens")
            self.pool.fill(tail, kept_in_tail)
        return num_kept_blocks if dropped else None

    # -- release and sharing ------------------------------------------------------------------

    def free(self, request: Request) -> None:
        table = self._tables.pop(request.request_id, None)
        if table is None:
            return
        self._cache_computed_blocks(request, table)
        # Last block first: a prefix is useless without its beginning, so the tail of a
        # cached sequence should be evicted before its head.
        self.pool.release(reversed(table.held))
        self.pool.release(table.state)
        if self._pending_copies:
            self._pending_copies.discard_into(lambda dst: not self.pool.blocks[dst].ref_cnt)

    def fork(self, parent: Request, child: Request) -> bool:
        """The child shares every block of the parent; the first write to a shared block
        copies it. Call between steps (after update, before the next schedule). The caller
        gives the child the parent's block hashes for the tokens they share."""
        table = self._tables.get(parent.request_id)
        if table is None:
            raise ValueError(f"cannot fork {parent.request_id}: it holds no blocks")
        if child.request_id in self._tables:
            raise ValueError(f"cannot fork into {child.request_id}: it already holds blocks")
        if len(table.state) > self.pool.num_free_blocks:
            return False  # no room for the state's copy: the child is recomputed later
        state = self._take_state_pages(len(table.state))
        for src, dst in zip(table.state, state):
            self._pending_copies.add(src.block_id, dst.block_id)
        self.pool.touch(table.held)
        child_table = _BlockTable(list(table.blocks), num_cached=table.num_cached,
                                  num_freed=table.num_freed, state=state)
        self._tables[child.request_id] = child_table
        return True

    def _take_state_pages(self, n: int) -> list[KVBlock]:
        pages = self.pool.take(n, RECURRENT_STATE)
        for page in pages:  # a state fills its pages: they count as used slots, not waste
            self.pool.fill(page, self.block_size)
        return pages

    def block_ids(self, request: Request) -> list[int]:
        table = self._tables.get(request.request_id)
        return table.ids if table is not None else []

    def state_pages(self, request: Request) -> list[int]:
        """The pages of the request's recurrent state, in order (none without recurrent layers)."""
        table = self._tables.get(request.request_id)
        return [b.block_id for b in table.state] if table is not None else []

    def take_block_copies(self) -> list[tuple[int, int]]:
        """(src, dst) copies to do before the next model run: no block is both a source and
        a destination, so they may be done all at once."""
        return self._pending_copies.take()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any request holds blocks."""
        return self.pool.reset_prefix_cache()

    def block_map(self) -> BlockMap:
        """Every block's state, ref count, fill and owners: the dashboard's picture."""
        return paged_block_map(
            self.pool.blocks, self.block_size,
            ((rid, table.ids[table.num_freed:] + [b.block_id for b in table.state], table.num_freed)
             for rid, table in self._tables.items()),
            self._pending_copies.destinations())

    def _pages_by_kind(self) -> dict[str, int]:
        """Pages in use by kind: every kind this pool holds, none in use included."""
        kinds = [self.pool.kv_kind] + [RECURRENT_STATE] * bool(self.state_pages_per_request)
        return {kind: self.pool.num_owned_by_kind.get(kind, 0) for kind in kinds}

    def stats(self) -> KVStats:
        num_free = self.pool.num_free_blocks
        return KVStats(
            num_blocks=self.num_blocks, num_free_blocks=num_free, block_size=self.block_size,
            allocated_slots=(self.num_blocks - num_free) * self.block_size,
            used_slots=self.pool.num_used_slots, bytes_per_block=self.bytes_per_block,
            num_cached_free_blocks=self.pool.num_cached_free,
            prefix_cache_queries=self._prefix_queries, prefix_cache_hits=self._prefix_hits,
            pages_by_kind=self._pages_by_kind(),
            state_pages_per_request=self.state_pages_per_request)
