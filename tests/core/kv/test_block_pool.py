from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.kv.block_pool import BlockPool, FreeBlockQueue, KVBlock, PendingCopies


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_primitives_keep_links_and_counts():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert ids(queue) == [0, 1, 2, 3, 4] and len(queue) == 5
    queue.remove(blocks[2])  # from the middle
    assert ids(queue) == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    queue.appendleft(blocks[0])
    assert ids(queue) == [0, 1, 3, 4, 2] and len(queue) == 5
    assert ids(queue.popleft_n(3)) == [0, 1, 3]
    assert ids(queue) == [4, 2] and len(queue) == 2


def test_free_queue_refuses_misuse():
    block = KVBlock(0)
    queue = FreeBlockQueue([block])
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(block)
    with pytest.raises(ValueError, match="No free blocks available"):
        queue.popleft_n(2)
    queue.popleft()
    with pytest.raises(ValueError, match="No free blocks available"):
        queue.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(block)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["pop", "remove", "append", "appendleft"]),
                          st.integers(0, 7)), max_size=60))
def test_free_queue_matches_a_list_model(ops):
    blocks = [KVBlock(i) for i in range(8)]
    queue, model = FreeBlockQueue(blocks), list(range(8))
    for op, i in ops:
        if op == "pop" and model:
            assert queue.popleft().block_id == model.pop(0)
        elif op == "remove" and i in model:
            queue.remove(blocks[i])
            model.remove(i)
        elif op in ("append", "appendleft") and i not in model:
            getattr(queue, op)(blocks[i])
            model.insert(len(model) if op == "append" else 0, i)
        assert ids(queue) == model and len(queue) == len(model)


def test_pool_takes_in_id_order_and_frees_at_zero_refs():
    pool = BlockPool(4)
    first = pool.take(2)
    assert ids(first) == [0, 1] and all(b.ref_cnt == 1 for b in first)
    pool.touch([first[0]])  # a second holder
    pool.release(first)
    assert first[0].ref_cnt == 1 and pool.num_free_blocks == 3
    pool.release([first[0]])
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError, match="released more often"):
        pool.release([first[0]])
    with pytest.raises(ValueError, match="No free blocks"):
        pool.take(5)


def test_cached_blocks_wait_at_the_tail_and_are_evicted_when_taken():
    pool = BlockPool(4)
    a, b, c, d = pool.take(4)
    pool.cache(a, b"h-a", (1,), None, None)
    pool.cache(b, b"h-b", (2,), a, None)
    pool.release([b, a, c])  # c holds nothing worth keeping: it goes to the head
    assert ids(pool.free_queue) == [2, 1, 0]
    assert pool.num_cached_free == 2
    epoch = b.cache_epoch
    assert ids(pool.take(2)) == [2, 1]  # b evicted: its hash is gone
    assert not b.is_cached and b.cache_epoch == epoch + 1 and pool.cached_blocks(b"h-b") == []
    assert pool.cached_blocks(b"h-a") == [a] and pool.num_cached_free == 1
    pool.touch([a])  # a hit revives it out of the free queue
    assert a.ref_cnt == 1 and pool.num_free_blocks == 0 and pool.num_cached_free == 0


def test_used_slots_follow_ref_counts():
    pool = BlockPool(3)
    a, b = pool.take(2)
    pool.fill(a, 4)
    pool.fill(b, 2)
    assert pool.num_used_slots == 6
    pool.touch([a])  # shared: still counted once
    assert pool.num_used_slots == 6
    pool.cache(a, b"h", (1, 2, 3, 4), None, None)
    pool.release([a, a, b])
    assert pool.num_used_slots == 0
    pool.touch([a])  # revived with its four cached tokens
    assert pool.num_used_slots == 4


def test_reset_prefix_cache_only_when_nothing_is_owned():
    pool = BlockPool(2)
    (a,) = pool.take(1)
    pool.cache(a, b"h", (1,), None, None)
    assert not pool.reset_prefix_cache()
    pool.release([a])
    assert pool.reset_prefix_cache()
    assert not a.is_cached and pool.cached_blocks(b"h") == [] and pool.num_cached_free == 0


def test_blocks_a_reset_uncached_are_taken_before_blocks_never_used():
    """Their memory is written already; a block never used would cost page faults first."""
    pool = BlockPool(6)
    used = pool.take(3)
    for i, block in enumerate(used):
        pool.cache(block, bytes([i]), (i,), None, None)
    pool.release(used)
    assert [b.block_id for b in pool.free_queue][:3] == [3, 4, 5]  # cached ones wait at the tail
    assert pool.reset_prefix_cache()
    assert sorted(b.block_id for b in pool.take(3)) == [0, 1, 2]


def test_pending_copies_resolve_chains_so_they_can_run_at_once():
    copies = PendingCopies()
    copies.add(1, 2)
    copies.add(2, 3)  # 2 still waits for 1's contents: copy from 1 directly
    copies.add(4, 5)
    copies.add(5, 4)  # back: 4 already holds what 5 will get, no copy needed
    assert copies.take() == [(1, 2), (1, 3), (4, 5)]
    assert not copies and copies.take() == []
    copies.add(1, 2)
    copies.add(3, 2)  # the later copy into 2 wins
    copies.add(6, 7)
    copies.discard_into(lambda block: block == 7)  # 7 was given back before the step
    assert copies.take() == [(3, 2)]
