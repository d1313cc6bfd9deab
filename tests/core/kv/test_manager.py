from __future__ import annotations

import pytest

from pagedllm.core.kv import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.utils import cdiv
from tests.core.kv.sim import check_paged_manager


def req(request_id: str, num_tokens: int, first_token: int = 1) -> Request:
    return Request(request_id, list(range(first_token, first_token + num_tokens)))


def compute(request: Request, manager: KVCacheManager, num_new: int) -> bool:
    """One scheduler step for one request: allocate, then mark the tokens computed."""
    ok = manager.allocate_slots(request, num_new)
    if ok:
        request.num_computed_tokens += num_new
    return ok


def test_allocation_takes_ceil_tokens_over_block_size_in_id_order():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    a, b = req("a", 10), req("b", 4)
    assert manager.allocate_slots(a, 10) and manager.block_ids(a) == [0, 1, 2]
    assert manager.allocate_slots(b, 4) and manager.block_ids(b) == [3]
    assert manager.stats().num_free_blocks == 4
    check_paged_manager(manager)


def test_decode_fills_the_partial_tail_before_taking_a_block():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", 6)
    compute(a, manager, 6)
    table = manager.block_ids(a)
    assert table == [0, 1]
    a.append_token(7)
    a.append_token(8)
    compute(a, manager, 1)
    compute(a, manager, 1)  # the tail holds 8 tokens now: still two blocks
    assert manager.block_ids(a) == [0, 1]
    a.append_token(9)
    compute(a, manager, 1)
    assert manager.block_ids(a) == [0, 1, 2]
    assert manager.block_ids(a) is table  # the live list, appended to, never rebuilt


def test_failed_allocation_changes_nothing():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    a, b = req("a", 8), req("b", 12)
    compute(a, manager, 8)
    before = manager.stats()
    assert not manager.allocate_slots(b, 12)  # needs 3 blocks, 2 free
    assert manager.block_ids(b) == [] and manager.stats() == before
    c = req("c", 8)
    compute(c, manager, 8)  # the last two blocks
    a.append_token(0)
    before = manager.stats()
    assert not manager.allocate_slots(a, 1)  # a running request cannot grow either
    assert manager.block_ids(a) == [0, 1] and manager.stats() == before
    check_paged_manager(manager)


def test_free_returns_every_block_and_ignores_unknown_requests():
    manager = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", 5)
    compute(a, manager, 5)
    manager.free(a)
    manager.free(a)
    manager.free(req("never-seen", 3))
    stats = manager.stats()
    assert stats.num_free_blocks == 4 and stats.used_slots == 0 and manager.block_ids(a) == []


def test_fork_shares_every_block_and_copies_on_first_write():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    parent = req("p", 6)
    compute(parent, manager, 6)  # blocks 0 (full) and 1 (2 of 4 slots)
    child = Request("c", parent.prompt_token_ids)
    child.num_computed_tokens = 6
    parent.append_token(100)
    child.append_token(200)
    manager.fork(parent, child)
    assert manager.block_ids(child) == [0, 1]
    assert [manager.pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    assert manager.stats().used_slots == 6  # shared slots count once
    check_paged_manager(manager)

    compute(parent, manager, 1)  # writes into the shared partial block 1: copy first
    assert manager.block_ids(parent) == [0, 2]
    assert manager.take_block_copies() == [(1, 2)]
    assert manager.take_block_copies() == []
    compute(child, manager, 1)  # block 1 is the child's alone now: no copy
    assert manager.block_ids(child) == [0, 1] and manager.take_block_copies() == []
    assert [manager.pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 1, 1]
    assert manager.stats().used_slots == 4 + 3 + 3
    check_paged_manager(manager)

    manager.free(parent)
    assert manager.pool.blocks[0].ref_cnt == 1  # still the child's
    manager.free(child)
    assert manager.stats().num_free_blocks == 8


def test_fork_at_a_block_boundary_needs_no_copy():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    parent = req("p", 4)
    compute(parent, manager, 4)
    child = Request("c", parent.prompt_token_ids)
    child.num_computed_tokens = 4
    manager.fork(parent, child)
    parent.append_token(5)
    child.append_token(6)
    compute(parent, manager, 1)
    compute(child, manager, 1)
    assert manager.take_block_copies() == []
    assert manager.block_ids(parent) == [0, 1] and manager.block_ids(child) == [0, 2]


def test_copy_on_write_is_atomic_too():
    manager = KVCacheManager(num_blocks=2, block_size=4)
    parent = req("p", 6)
    compute(parent, manager, 6)  # both blocks in use
    child = Request("c", parent.prompt_token_ids)
    child.num_computed_tokens = 6
    manager.fork(parent, child)
    parent.append_token(7)
    assert not manager.allocate_slots(parent, 1)  # the copy needs a free block
    assert manager.block_ids(parent) == [0, 1] and manager.take_block_copies() == []
    assert manager.pool.blocks[1].ref_cnt == 2


def test_a_copy_into_a_freed_block_is_dropped():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    parent = req("p", 2)
    compute(parent, manager, 2)
    child = Request("c", parent.prompt_token_ids)
    child.num_computed_tokens = 2
    manager.fork(parent, child)
    child.append_token(9)
    assert manager.allocate_slots(child, 1)  # copy 0 -> 1 pending ...
    manager.free(child)  # ... and the child preempted before the step ran
    assert manager.take_block_copies() == []


def test_waste_is_under_one_block_per_request():
    for block_size in (1, 4, 16):
        manager = KVCacheManager(num_blocks=64, block_size=block_size, bytes_per_block=1024)
        lengths = [1, 5, 17, 31]
        for i, n in enumerate(lengths):
            compute(req(f"r{i}", n), manager, n)
        stats = manager.stats()
        assert stats.used_slots == sum(lengths)
        assert stats.allocated_slots == sum(cdiv(n, block_size) * block_size for n in lengths)
        assert stats.waste_slots <= len(lengths) * (block_size - 1)
        assert stats.waste_bytes == stats.waste_slots * 1024 // block_size


def test_stats_figures():
    manager = KVCacheManager(num_blocks=10, block_size=4, bytes_per_block=400)
    compute(req("a", 6), manager, 6)
    stats = manager.stats().to_dict()
    assert stats["num_free_blocks"] == 8 and stats["usage"] == pytest.approx(0.2)
    assert stats["allocated_slots"] == 8 and stats["used_slots"] == 6
    assert stats["waste_slots"] == 2 and stats["waste_pct"] == pytest.approx(25.0)
    assert stats["allocated_bytes"] == 800 and stats["used_bytes"] == 600
    assert manager.max_tokens_per_request(max_chunk_tokens=8) == 40

