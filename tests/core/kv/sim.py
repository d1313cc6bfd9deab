"""Test helpers: a simulated runner that stores "K/V" per physical slot, and invariant checks
for the KV managers and the scheduler.

The simulated K/V of a token is what real K/V depends on: the whole prefix up to and
including it (plus the cache salt, so a cross-salt hit shows up as wrong content), a speculative
step's proposed tokens included (so K/V of a rejected proposal, read later, shows up too). After
every write the runner reads each scheduled request's whole context back through its block
table, so a wrong prefix hit, a missed copy-on-write or a block handed to two writers shows
up as a content mismatch. With a sliding window it reads what attention reads: the window of
the step's first new token on; the entries before it must be holes (given back), those in it
real blocks.

A hybrid model's recurrent state (a manager with state pages) depends on the computed tokens: each
of a request's state pages holds (its index, the computed prefix) in its first slot. A step reads
them back (except on a request's first tokens, which start from zero) and writes the state after
its tokens; a fork's copies carry the parent's. So a state page lost, shared, or not copied at a
fork shows up as a mismatch.
"""

from __future__ import annotations

from collections import Counter

from pagedllm.core.kv.contiguous import ContiguousKVManager
from pagedllm.core.kv.kinds import RECURRENT_STATE
from pagedllm.core.kv.manager import NULL_BLOCK, KVCacheManager, peak_blocks
from pagedllm.core.kv.slots import request_slots
from pagedllm.core.kv.snapshot import CACHED, COPYING, FREE, SHARED, USED, BlockMap, runs
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput


def kv_content(request: Request, position: int) -> tuple:
    """What K/V at `position` holds: the prefix up to it, proposed (speculative) tokens included."""
    tokens = request.token_ids + request.spec_token_ids if request.spec_token_ids else request.token_ids
    return (request.cache_salt, tuple(tokens[:position + 1]))


def new_token_slots(item: ScheduledRequest) -> list[int]:
    """The physical slots a scheduled request writes this step."""
    return request_slots(item.block_ids, item.num_computed_tokens, item.num_context_tokens,
                         item.block_size)


class SimRunner:
    def __init__(self, num_blocks: int, block_size: int, sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.slots: list[tuple | None] = [None] * (num_blocks * block_size)

    def execute(self, output: SchedulerOutput) -> None:
        bs = self.block_size
        # All at once, like the runner's batched copy: gather every source, then scatter.
        sources = [self.slots[src * bs:(src + 1) * bs] for src, _ in output.block_copies]
        for (_, dst), content in zip(output.block_copies, sources):
            self.slots[dst * bs:(dst + 1) * bs] = content
        # Like a model layer: write every new token's K/V, then attend over the contexts.
        for item in output.scheduled:
            for pos, slot in zip(range(item.num_computed_tokens, item.num_context_tokens),
                                 new_token_slots(item), strict=True):
                self.slots[slot] = kv_content(item.request, pos)
        for item in output.scheduled:
            self.run_state(item)
        for item in output.scheduled:
            first = self.first_read(item)
            first_block = first // bs
            ids = item.block_ids
            assert all(i == NULL_BLOCK for i in ids[:first_block]), "a block before the window is held"
            assert NULL_BLOCK not in ids[first_block:], "a hole in the window"
            context = request_slots(ids, first, item.num_context_tokens, bs)
            for pos, slot in enumerate(context, start=first):
                got = self.slots[slot]
                want = kv_content(item.request, pos)
                assert got == want, (f"{item.request.request_id} position {pos}: "
                                     f"read {got}, expected {want}")

    def run_state(self, item: ScheduledRequest) -> None:
        tokens = tuple(item.request.token_ids)
        for i, page in enumerate(item.state_pages):
            if item.num_computed_tokens:
                got = self.slots[page * self.block_size]
                want = ("state", i, tokens[:item.num_computed_tokens])
                assert got == want, f"{item.request.request_id} state page {i}: read {got}, expected {want}"
            self.slots[page * self.block_size] = ("state", i, tokens[:item.num_context_tokens])

    def first_read(self, item: ScheduledRequest) -> int:
        """The first position attention reads this step, rounded down to its block."""
        if self.sliding_window is None:
            return 0
        first = max(0, item.num_computed_tokens - self.sliding_window + 1)
        return first - first % self.block_size


def check_paged_manager(manager: KVCacheManager) -> None:
    pool = manager.pool
    owners = Counter(b.block_id for t in manager._tables.values() for b in t.held + t.state)
    num_free = 0
    for block in pool.blocks:
        assert block.ref_cnt == owners[block.block_id], block
        in_queue = block.prev_free is not None
        assert in_queue == (block.ref_cnt == 0), block
        num_free += block.ref_cnt == 0
    assert num_free == pool.num_free_blocks == len(list(pool.free_queue))
    assert num_free + len(owners) == manager.num_blocks
    assert pool.num_cached_free == sum(1 for b in pool.free_queue if b.is_cached)
    assert pool.num_used_slots == sum(b.num_filled for b in pool.blocks if b.ref_cnt)
    for block in pool.blocks:
        if block.is_cached:
            assert any(b is block for b in pool.cached_blocks(block.block_hash))
            assert len(block.cache_tokens) == manager.block_size
    assert sum(len(pool.cached_blocks(h)) for h in list(pool._cached)) == \
        sum(1 for b in pool.blocks if b.is_cached)
    check_page_kinds(manager)
    for table in manager._tables.values():
        assert table.ids == [NULL_BLOCK] * table.num_freed + [b.block_id for b in table.held]
        assert None not in table.held and not any(table.blocks[:table.num_freed])
        assert len(set(table.ids[table.num_freed:])) == len(table.held)
        assert manager.sliding_window is not None or not table.num_freed
    if not manager.enable_prefix_caching:
        assert not any(b.is_cached for b in pool.blocks)


def check_page_kinds(manager: KVCacheManager) -> None:
    """Every owned page holds one kind, the kind of where it is used, and the counts per kind add
    up: KV pages in block tables (shared or not, cached or not), a fixed number of state pages per
    request (never shared, never cached)."""
    pool = manager.pool
    kv_ids = {b.block_id for t in manager._tables.values() for b in t.held}
    state_ids = [b.block_id for t in manager._tables.values() for b in t.state]
    assert len(state_ids) == len(set(state_ids)) and kv_ids.isdisjoint(state_ids)
    for table in manager._tables.values():
        assert len(table.state) == manager.state_pages_per_request
        for page in table.state:
            assert page.kind == RECURRENT_STATE and page.ref_cnt == 1 and not page.is_cached
            assert page.num_filled == manager.block_size
    for block_id in kv_ids:
        assert pool.blocks[block_id].kind == pool.kv_kind
    by_kind = Counter(b.kind for b in pool.blocks if b.ref_cnt)
    assert {k: n for k, n in pool.num_owned_by_kind.items() if n} == dict(by_kind)
    assert by_kind[RECURRENT_STATE] == len(state_ids) and by_kind[pool.kv_kind] == len(kv_ids)
    assert {k: n for k, n in manager.stats().pages_by_kind.items() if n} == dict(by_kind)
    assert sum(by_kind.values()) + pool.num_free_blocks == manager.num_blocks


def check_contiguous_manager(manager: ContiguousKVManager) -> None:
    spans = sorted([(r.start, r.num_blocks) for r in manager._reservations.values()]
                   + manager.free_runs)
    position = 0
    for start, length in spans:  # reservations and free runs tile [0, num_blocks) exactly
        assert start == position and length > 0, spans
        position += length
    assert position == manager.num_blocks
    runs = manager.free_runs
    assert all(a[0] + a[1] < b[0] for a, b in zip(runs, runs[1:])), runs  # merged
    assert manager.stats().num_free_blocks == sum(length for _, length in runs)


def check_manager(manager) -> None:
    if isinstance(manager, KVCacheManager):
        check_paged_manager(manager)
    else:
        check_contiguous_manager(manager)
    check_block_map(manager)


def check_block_map(manager) -> None:
    """The dashboard's picture agrees with the manager's own figures and block tables, and
    survives its JSON encoding."""
    picture = manager.block_map()
    assert BlockMap.from_dict(picture.to_dict()) == picture
    stats, counts = manager.stats(), picture.counts()
    assert picture.num_blocks == stats.num_blocks and picture.block_size == stats.block_size
    assert counts["free"] + counts["cached"] == stats.num_free_blocks
    assert counts["cached"] == stats.num_cached_free_blocks
    in_use = [i for i, state in enumerate(picture.states) if state not in (FREE, CACHED)]
    assert len(in_use) == stats.num_used_blocks
    assert sum(picture.filled[i] for i in in_use) == stats.used_slots
    tables = ({rid: t.ids[t.num_freed:] + [b.block_id for b in t.state]
               for rid, t in manager._tables.items()}
              if isinstance(manager, KVCacheManager)
              else {rid: r.ids for rid, r in manager._reservations.items()})
    if isinstance(manager, KVCacheManager):
        assert picture.freed == {rid: t.num_freed for rid, t in manager._tables.items() if t.num_freed}
    assert set(picture.owners) == set(tables)
    owners = Counter()
    for request_id, request_runs in picture.owners.items():
        ids = [start + k for start, length in request_runs for k in range(length)]
        assert ids == tables[request_id] and request_runs == runs(ids)  # runs are maximal
        owners.update(ids)
    for i, state in enumerate(picture.states):
        ref = picture.ref_counts[i]
        assert ref == owners[i]
        assert (state == FREE or state == CACHED) == (ref == 0), (i, state, ref)
        assert state != SHARED or ref > 1
        assert state != USED or ref == 1
        assert state != FREE or picture.filled[i] == 0
        assert state != COPYING or ref >= 1


def check_scheduler(scheduler: Scheduler) -> None:
    manager = scheduler.kv_manager
    check_manager(manager)
    running, waiting = scheduler.running, list(scheduler.waiting)
    assert len({id(r) for r in running + waiting}) == len(running) + len(waiting)
    assert {r.request_id for r in running + waiting} == set(scheduler._requests)
    for request in running:
        assert request.status is RequestStatus.RUNNING
        assert manager.block_ids(request)
        assert request.num_computed_tokens <= request.num_tokens
    for request in waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert request.num_computed_tokens == 0 and not manager.block_ids(request)
        assert not manager.state_pages(request)


def check_output(scheduler: Scheduler, output: SchedulerOutput) -> None:
    config, manager = scheduler.config, scheduler.kv_manager
    assert len(output.scheduled) <= config.max_num_seqs
    assert output.num_batched_tokens == sum(s.num_new_tokens for s in output.scheduled)
    assert output.num_batched_tokens <= config.max_num_batched_tokens
    assert len({id(s.request) for s in output.scheduled}) == len(output.scheduled)
    written: set[int] = set()
    for item in output.scheduled:
        assert item.num_new_tokens >= 1
        assert item.num_context_tokens <= item.request.num_tokens
        assert item.block_ids is manager.block_ids(item.request)  # the live list
        slots = new_token_slots(item)
        assert written.isdisjoint(slots), "two requests write the same slot"
        written.update(slots)
        if isinstance(manager, KVCacheManager):
            for block_id in {slot // manager.block_size for slot in slots}:
                assert manager.pool.blocks[block_id].ref_cnt == 1, "write to a shared block"
            # A window bounds what a request holds, however long it is.
            held = len(item.block_ids) - item.block_ids.count(NULL_BLOCK)
            assert held <= peak_blocks(item.num_context_tokens, manager.block_size,
                                       manager.sliding_window, config.max_num_batched_tokens)
    assert_copies_batchable(output.block_copies)


def assert_copies_batchable(copies: list[tuple[int, int]]) -> None:
    """The runner does a step's copies at once (every source read, then every destination written:
    kv_quant.copy_blocks), and each copy means "the source's contents before this step" (pending
    copies resolve chains to their first source): so no block is written twice or into itself. A
    block may be both read and written, even crosswise: a freed state page still to be copied from
    can be taken again as another fork's state page, a swap that no order of single copies does
    but the batched one does (the SimRunner, which copies the same way, checks the contents)."""
    dsts = [dst for _, dst in copies]
    assert len(set(dsts)) == len(dsts), copies
    assert all(src != dst for src, dst in copies), copies
