"""Sliding windows in the paged KV manager: blocks no layer reads again are given back as a
request advances, leaving holes at the front of its table; prefix hits, forks, preemption and
the capacity check stay right with them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv.manager import NULL_BLOCK, UNBOUNDED, KVCacheManager, peak_blocks
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import cdiv
from tests.core.kv.sim import SimRunner, check_output, check_paged_manager, check_scheduler


def decode(manager: KVCacheManager, request: Request, token: int = 7) -> None:
    request.append_token(token)
    assert manager.allocate_slots(request, 1)
    request.num_computed_tokens += 1


def held(manager: KVCacheManager, request: Request) -> list[int]:
    return [i for i in manager.block_ids(request) if i != NULL_BLOCK]


def test_a_long_decode_holds_the_window_and_one_block_more():
    """The issue's case: a 32-token window over blocks of 8 tokens, 2,000 tokens generated."""
    manager = KVCacheManager(num_blocks=8, block_size=8, sliding_window=32)
    request = Request("a", list(range(1, 11)))
    assert manager.allocate_slots(request, 10)
    request.num_computed_tokens = 10
    most = 0
    for _ in range(2000):
        decode(manager, request)
        most = max(most, len(held(manager, request)))
        assert manager.stats().num_used_blocks == len(held(manager, request))
        check_paged_manager(manager)
    assert most == cdiv(32, 8) + 1 == 5
    ids = manager.block_ids(request)
    assert len(ids) == cdiv(2010, 8)  # logical positions kept: holes in front
    first_needed = (2009 - 32 + 1) // 8
    assert ids[:first_needed] == [NULL_BLOCK] * first_needed and NULL_BLOCK not in ids[first_needed:]
    manager.free(request)
    assert manager.stats().num_free_blocks == 8


def test_a_prompt_chunk_holds_its_own_blocks_and_the_window_before_it():
    manager = KVCacheManager(num_blocks=64, block_size=4, sliding_window=6)
    request = Request("a", list(range(100)))
    for start in range(0, 100, 20):
        assert manager.allocate_slots(request, 20)
        # Positions start - 5 .. start + 19 are read: blocks from (start - 5) // 4 on.
        first = max(0, start - 5) // 4
        assert manager.block_ids(request)[:first] == [NULL_BLOCK] * first
        assert len(held(manager, request)) == cdiv(start + 20, 4) - first
        assert len(held(manager, request)) <= peak_blocks(100, 4, 6, 20)
        request.num_computed_tokens += 20


def test_freed_blocks_stay_cached_and_a_later_hit_takes_only_its_window():
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True,
                             sliding_window=6)
    a = Request("a", list(range(1, 25)))  # six full blocks
    assert manager.allocate_slots(a, 24)
    a.num_computed_tokens = 24
    decode(manager, a)  # caches the six blocks, then gives back those before (24 - 5)
    assert manager.block_ids(a)[:4] == [NULL_BLOCK] * 4
    assert manager.stats().num_cached_free_blocks == 4  # given back, still holding the prefix
    manager.free(a)
    b = Request("b", list(range(1, 25)) + [99])
    hit = manager.find_cached_prefix(b)
    assert hit.num_tokens == 24
    free_before = manager.stats().num_free_blocks
    assert manager.allocate_slots(b, 1, hit)
    # b's first new token (position 24) reads back to position 19: block 4 on. The hit blocks
    # before it are holes from the start, never revived.
    ids = manager.block_ids(b)
    assert ids[:4] == [NULL_BLOCK] * 4 and ids[4:6] == [blk.block_id for blk in hit.blocks[4:]]
    assert all(blk.ref_cnt == 0 for blk in hit.blocks[:4])
    assert manager.stats().num_free_blocks == free_before - 3  # 2 revived + 1 new
    check_paged_manager(manager)


def test_a_hit_never_reaches_past_a_freed_block_that_was_evicted():
    manager = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True,
                             sliding_window=4)
    a = Request("a", list(range(1, 17)))  # four full blocks
    assert manager.allocate_slots(a, 16)
    a.num_computed_tokens = 16
    first = manager.pool.blocks[manager.block_ids(a)[0]]
    decode(manager, a)  # blocks 0-2 of a given back (cached); block 3 and a new one held
    assert manager.block_ids(a)[:3] == [NULL_BLOCK] * 3 and first.is_cached
    other = Request("b", [50] * 16)  # takes every free block: the cached ones are evicted
    assert manager.allocate_slots(other, 16)
    assert not first.is_cached
    assert manager.find_cached_prefix(Request("c", list(range(1, 17)) + [0])).num_tokens == 0
    check_paged_manager(manager)


def test_a_cached_chain_ends_where_a_block_was_freed_before_its_child_was_computed():
    """A window of one token frees every block but the newest: the next block cannot name its
    parent, so it is not cached (nor anything after it)."""
    manager = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True,
                             sliding_window=1)
    a = Request("a", [1, 2, 3])
    assert manager.allocate_slots(a, 3)
    a.num_computed_tokens = 3
    for token in (4, 5, 6, 7):
        decode(manager, a, token)
        assert len(held(manager, a)) <= peak_blocks(a.num_tokens, 2, 1, 3)
    manager.free(a)
    hit = manager.find_cached_prefix(Request("b", [1, 2, 3, 4, 5, 6, 7, 8]))
    assert hit.num_tokens == 2  # block 0 was cached before it was given back; block 1 never
    check_paged_manager(manager)


def test_a_fork_shares_the_held_blocks_and_the_holes():
    manager = KVCacheManager(num_blocks=16, block_size=4, sliding_window=5)
    parent = Request("p", list(range(1, 21)))
    assert manager.allocate_slots(parent, 20)
    parent.num_computed_tokens = 20
    decode(manager, parent)
    child = Request("c", parent.token_ids[:-1] + [8])
    assert manager.fork(parent, child)
    assert manager.block_ids(child) == manager.block_ids(parent)
    for block_id in held(manager, parent):
        assert manager.pool.blocks[block_id].ref_cnt == 2
    child.num_computed_tokens = parent.num_computed_tokens
    decode(manager, child)  # writes the shared tail: its own copy, nothing else changes
    assert manager.take_block_copies()
    manager.free(parent)
    manager.free(child)
    assert manager.stats().num_free_blocks == 16
    check_paged_manager(manager)


def test_a_window_keeps_any_length_within_a_cache_that_holds_a_chunk_and_the_window():
    manager = KVCacheManager(num_blocks=7, block_size=4, sliding_window=8)
    assert peak_blocks(UNBOUNDED, 4, 8, 18) == cdiv(18 + 8 - 2, 4) + 1 == 7
    assert manager.max_tokens_per_request(max_chunk_tokens=18) == UNBOUNDED
    # Wider chunks are cut to what the cache holds (the scheduler asks max_step_tokens), so any
    # length still fits; a cache that cannot hold one decode's window has no such cut.
    assert manager.max_step_tokens == 18
    assert manager.max_tokens_per_request(max_chunk_tokens=19) == UNBOUNDED
    small = KVCacheManager(num_blocks=2, block_size=4, sliding_window=8)
    assert small.max_step_tokens is None and small.max_tokens_per_request(max_chunk_tokens=1) == 8
    assert KVCacheManager(7, 4).max_tokens_per_request(max_chunk_tokens=1) == 28
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(7, 4, sliding_window=0)


@settings(max_examples=200, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4, 8, 16]), window=st.integers(1, 70),
       chunk=st.integers(1, 40), length=st.integers(1, 200))
def test_the_peak_bound_holds_and_is_reached(block_size, window, chunk, length):
    """Compute `length` tokens in chunks: the most blocks held is never above peak_blocks, and
    equals it for some chunk alignment (the bound is not loose)."""
    def most_held(first_chunk: int) -> int:
        manager = KVCacheManager(num_blocks=cdiv(length, block_size), block_size=block_size,
                                 sliding_window=window)
        request = Request("a", [1] * length)
        most, start, size = 0, 0, first_chunk
        while start < length:
            size = min(size, length - start)
            assert manager.allocate_slots(request, size)
            request.num_computed_tokens = start = start + size
            most = max(most, len(held(manager, request)))
            size = chunk
        return most

    bound = peak_blocks(length, block_size, window, chunk)
    results = [most_held(first) for first in range(1, min(chunk, length) + 1)]
    assert max(results) <= bound
    if length >= chunk + window + 2 * block_size:  # room for every alignment
        assert max(results) == bound


def test_preemption_recomputes_everything_and_holds_no_more_than_the_window_meanwhile():
    """A window does not shorten recompute: a token's K/V in layer l depends on up to l windows
    of tokens before it, so the scheduler starts over (from any cached prefix). The manager frees
    behind the recomputing prefill as it goes."""
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=200)
    manager = KVCacheManager(num_blocks=7, block_size=4, sliding_window=8)
    scheduler = Scheduler(config, manager)
    runner = SimRunner(7, 4, sliding_window=8)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    a, b = Request("a", list(range(1, 41)), params), Request("b", list(range(50, 90)), params)
    scheduler.add_request(a)
    scheduler.add_request(b)
    preempted = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        check_output(scheduler, out)
        runner.execute(out)
        preempted += out.preempted
        scheduler.update_from_output(out, {s.request.request_id: 3 for s in out.scheduled if s.samples})
        check_scheduler(scheduler)
    assert preempted and a.num_output_tokens == b.num_output_tokens == 60
