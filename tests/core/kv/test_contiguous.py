from __future__ import annotations

import pytest

from pagedllm.core.kv import ContiguousKVManager, KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams
from tests.core.kv.sim import check_contiguous_manager


def req(request_id: str, num_tokens: int, max_tokens: int | None = 16) -> Request:
    return Request(request_id, [1] * num_tokens, SamplingParams(max_tokens=max_tokens))


def test_max_reserve_holds_max_model_len_whatever_the_request():
    manager = ContiguousKVManager(num_blocks=16, block_size=4, max_model_len=20)
    a = req("a", 3)
    assert manager.allocate_slots(a, 3)
    assert manager.block_ids(a) == [0, 1, 2, 3, 4]  # one run of ceil(20 / 4) blocks
    stats = manager.stats()
    assert stats.allocated_slots == 20 and stats.used_slots == 3
    assert stats.waste_slots == 17 and stats.waste_pct == pytest.approx(85.0)
    a.num_computed_tokens = 3
    a.append_token(1)
    assert manager.allocate_slots(a, 1) and manager.block_ids(a) == [0, 1, 2, 3, 4]
    assert manager.stats().used_slots == 4


def test_request_reserve_is_prompt_plus_max_tokens_capped():
    manager = ContiguousKVManager(16, 4, max_model_len=40, reserve="request")
    short, capped, unbounded = req("s", 5, max_tokens=6), req("c", 30, 20), req("u", 2, None)
    assert manager.reservation_tokens(short) == 11
    assert manager.reservation_tokens(capped) == 40
    assert manager.reservation_tokens(unbounded) == 40
    assert manager.allocate_slots(short, 5) and manager.block_ids(short) == [0, 1, 2]


def test_first_fit_fragmentation_refuses_what_paging_accepts():
    manager = ContiguousKVManager(num_blocks=10, block_size=1, max_model_len=10,
                                  reserve="request")
    requests = [req(f"r{i}", 1, max_tokens=2) for i in range(3)]
    for r in requests:
        assert manager.allocate_slots(r, 1)  # runs [0,3) [3,6) [6,9); block 9 free
    manager.free(requests[1])
    assert manager.free_runs == [(3, 3), (9, 1)]
    big = req("big", 1, max_tokens=3)  # reserves 4 blocks
    before = manager.stats()
    assert before.num_free_blocks == 4 and not manager.allocate_slots(big, 1)
    assert manager.stats() == before and manager.block_ids(big) == []
    paged = KVCacheManager(num_blocks=4, block_size=1)  # paging takes any 4 free blocks
    assert paged.allocate_slots(req("big", 4), 4)
    check_contiguous_manager(manager)


def test_freed_runs_merge_with_their_neighbours():
    manager = ContiguousKVManager(num_blocks=9, block_size=1, max_model_len=3)
    a, b, c = req("a", 1), req("b", 1), req("c", 1)
    for r in (a, b, c):
        manager.allocate_slots(r, 1)
    manager.free(a)
    manager.free(c)
    assert manager.free_runs == [(0, 3), (6, 3)]
    manager.free(b)
    assert manager.free_runs == [(0, 9)]
    check_contiguous_manager(manager)


def test_fork_reserves_a_run_and_copies_the_used_blocks():
    manager = ContiguousKVManager(num_blocks=12, block_size=2, max_model_len=8)
    parent = req("p", 5)
    manager.allocate_slots(parent, 5)
    parent.num_computed_tokens = 5
    child = req("c", 5)
    assert manager.fork(parent, child)
    assert manager.block_ids(child) == [4, 5, 6, 7]
    assert manager.take_block_copies() == [(0, 4), (1, 5), (2, 6)]
    assert manager.stats().used_slots == 10
    third = req("t", 5)
    assert manager.fork(parent, third)  # blocks 8..11
    assert not manager.fork(parent, req("d", 5))  # no run left: nothing changes
    assert manager.block_ids(req("d", 5)) == []


def test_a_max_reserve_that_cannot_fit_holds_nothing():
    assert ContiguousKVManager(4, 4, max_model_len=17).max_tokens_per_request(max_chunk_tokens=8) == 0
    assert ContiguousKVManager(4, 4, max_model_len=16).max_tokens_per_request(max_chunk_tokens=8) == 16
    assert ContiguousKVManager(4, 4, 17, reserve="request").max_tokens_per_request(max_chunk_tokens=8) == 16


def test_outgrowing_a_reservation_is_an_error_not_a_silent_overwrite():
    manager = ContiguousKVManager(8, 2, max_model_len=4)
    a = req("a", 4)
    manager.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    with pytest.raises(RuntimeError, match="outgrew"):
        manager.allocate_slots(a, 1)


def test_bad_reserve_mode():
    with pytest.raises(ValueError, match="reserve"):
        ContiguousKVManager(4, 4, 16, reserve="sometimes")


def test_a_fork_of_a_fork_copies_from_the_original_even_if_the_middle_one_goes():
    manager = ContiguousKVManager(num_blocks=6, block_size=2, max_model_len=4)
    parent = req("p", 3)
    manager.allocate_slots(parent, 3)
    parent.num_computed_tokens = 3
    child, grandchild = req("c", 3), req("g", 3)
    child.num_computed_tokens = 3
    assert manager.fork(parent, child) and manager.fork(child, grandchild)
    manager.free(child)  # before the step that would have run the copies
    assert manager.take_block_copies() == [(0, 4), (1, 5)]
