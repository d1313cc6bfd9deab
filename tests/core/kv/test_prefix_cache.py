from __future__ import annotations

import pytest

from pagedllm.core.kv import prefix_hash
from pagedllm.core.kv.manager import KVCacheManager, PrefixHit
from pagedllm.core.request import Request
from tests.core.kv.sim import check_paged_manager


def admit(manager: KVCacheManager, request: Request) -> PrefixHit:
    """Admit a new request and compute all its tokens, as the scheduler and runner would."""
    hit = manager.find_cached_prefix(request)
    assert manager.allocate_slots(request, request.num_tokens - hit.num_tokens, hit)
    assert request.num_computed_tokens == 0  # the manager sets no request state
    request.num_computed_tokens = request.num_tokens
    return hit


def finish(manager: KVCacheManager, request: Request) -> None:
    manager.free(request)
    check_paged_manager(manager)


def test_hit_while_the_owner_runs_and_after_it_finished():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = Request("a", list(range(10)))  # two full blocks and a partial one
    admit(manager, a)
    # Blocks enter the cache once computed: the next allocation (or free) registers them.
    a.append_token(99)
    assert manager.allocate_slots(a, 1)
    b = Request("b", list(range(8)) + [50, 51])
    hit = admit(manager, b)
    assert hit.num_tokens == 8 and manager.block_ids(b)[:2] == manager.block_ids(a)[:2]
    assert [manager.pool.blocks[i].ref_cnt for i in manager.block_ids(a)[:2]] == [2, 2]
    finish(manager, a)
    finish(manager, b)
    free_before = manager.stats().num_free_blocks
    c = Request("c", list(range(8)) + [7])
    assert admit(manager, c).num_tokens == 8  # revived from the free queue
    assert manager.stats().num_free_blocks == free_before - 3  # 2 revived + 1 new
    stats = manager.stats()
    assert stats.prefix_cache_queries == 10 + 10 + 9 and stats.prefix_cache_hits == 16
    assert stats.prefix_cache_hit_rate == pytest.approx(16 / 29)


def test_a_hit_leaves_at_least_one_token_to_compute():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    admit(manager, a := Request("a", list(range(8))))
    finish(manager, a)
    same = Request("same", list(range(8)))
    hit = admit(manager, same)
    assert hit.num_tokens == 4  # whole-block prompt: the last block is recomputed
    one_more = Request("more", list(range(9)))
    finish(manager, same)
    assert manager.find_cached_prefix(one_more).num_tokens == 8


def test_blocks_are_not_cached_before_they_are_computed():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = Request("a", list(range(9)))
    assert manager.allocate_slots(a, 9)  # scheduled, not yet run
    assert manager.find_cached_prefix(Request("b", list(range(9)))).num_tokens == 0
    a.num_computed_tokens = 4  # a chunk ran
    a_more = manager.allocate_slots(a, 5)
    assert a_more and manager.find_cached_prefix(Request("b", list(range(9)))).num_tokens == 4


def test_eviction_is_lru_with_tails_before_heads():
    manager = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    a, b = Request("a", [1, 1, 2, 2, 3, 3, 9]), Request("b", [4, 4, 5, 5])
    admit(manager, a)  # blocks 0, 1, 2 cached when freed; 3 holds the lone 9
    admit(manager, b)  # blocks 4, 5
    finish(manager, a)
    finish(manager, b)
    queue = [blk.block_id for blk in manager.pool.free_queue]
    # Unhashed first, then a (tail to head), then b (tail to head): b is most recent.
    assert queue == [3, 2, 1, 0, 5, 4]
    assert manager.stats().num_cached_free_blocks == 5
    c = Request("c", [7] * 5)  # a miss needing three blocks
    admit(manager, c)
    assert manager.block_ids(c) == [3, 2, 1]
    assert manager.find_cached_prefix(Request("x", [1, 1, 2, 2, 3, 3, 0])).num_tokens == 2
    assert manager.find_cached_prefix(Request("y", [4, 4, 5, 5, 0])).num_tokens == 4


def test_a_hit_request_does_not_evict_its_own_hit_blocks():
    manager = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    admit(manager, a := Request("a", [1, 1, 2, 2]))
    finish(manager, a)  # free queue: [1, 0], both cached; 2 and 3 were never used
    b = Request("b", [1, 1, 2, 2, 3, 3, 4])  # hits 2 blocks, needs 2 more: exactly 4
    hit = admit(manager, b)
    assert hit.num_tokens == 4 and manager.block_ids(b)[:2] == [0, 1]
    assert manager.stats().num_free_blocks == 0
    check_paged_manager(manager)


def test_a_failed_allocation_with_a_hit_leaves_ref_counts_alone():
    manager = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    admit(manager, a := Request("a", [1, 1, 2, 2]))
    finish(manager, a)
    hog = Request("hog", [9, 9, 9])
    admit(manager, hog)  # takes blocks 2 and 3; 0 and 1 stay cached and free
    b = Request("b", [1, 1, 2, 2, 3, 3, 4])
    hit = manager.find_cached_prefix(b)
    assert hit.num_tokens == 4
    before = [blk.ref_cnt for blk in manager.pool.blocks]
    assert not manager.allocate_slots(b, 3, hit)
    assert [blk.ref_cnt for blk in manager.pool.blocks] == before and b.num_computed_tokens == 0
    assert manager.stats().prefix_cache_queries == 4 + 3  # the failed attempt is not counted
    check_paged_manager(manager)


def test_salt_keeps_prefixes_apart():
    manager = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    admit(manager, a := Request("a", [1, 2, 3, 4, 5], cache_salt="tenant-1"))
    finish(manager, a)
    assert manager.find_cached_prefix(Request("b", [1, 2, 3, 4, 5])).num_tokens == 0
    other = Request("c", [1, 2, 3, 4, 5], cache_salt="tenant-2")
    assert manager.find_cached_prefix(other).num_tokens == 0
    same = Request("d", [1, 2, 3, 4, 5], cache_salt="tenant-1")
    assert manager.find_cached_prefix(same).num_tokens == 4


def test_hashes_are_stable_chained_and_salted():
    root = prefix_hash.root_hash(None)
    first = prefix_hash.hash_block_tokens(root, [1, 2, 3, 4])
    # Pinned: the same bytes in every process and on every machine (no hash() seeds).
    assert first.hex() == prefix_hash.hash_block_tokens(root, (1, 2, 3, 4)).hex()
    assert first.hex() == "87fcb77fc3d572fa9d315df13e7b4c45"
    assert prefix_hash.hash_block_tokens(first, [1, 2, 3, 4]) != first  # parent matters
    assert prefix_hash.root_hash("s") != root
    hashes: list[bytes] = []
    prefix_hash.extend_block_hashes(hashes, list(range(10)), 4, 5, None)
    assert len(hashes) == 2  # only full blocks
    assert hashes[1] == prefix_hash.hash_block_tokens(hashes[0], [4, 5, 6, 7])


def test_collisions_are_confirmed_against_contents(monkeypatch):
    # Every block hashes the same: only the stored tokens and parents tell them apart.
    monkeypatch.setattr(prefix_hash, "hash_block_tokens", lambda parent, tokens: b"same")
    manager = KVCacheManager(num_blocks=16, block_size=2, enable_prefix_caching=True)
    a, b = Request("a", [1, 1, 2, 2, 0]), Request("b", [3, 3, 2, 2, 0])
    admit(manager, a)
    admit(manager, b)
    finish(manager, a)
    finish(manager, b)
    assert manager.find_cached_prefix(Request("x", [5, 5, 2, 2, 0])).num_tokens == 0
    via_a = Request("va", [1, 1, 2, 2, 7])
    assert admit(manager, via_a).num_tokens == 4
    assert manager.block_ids(via_a)[:2] == [0, 1]
    via_b = Request("vb", [3, 3, 2, 2, 7])  # same second block, other parent: b's blocks
    assert admit(manager, via_b).num_tokens == 4
    assert manager.block_ids(via_b)[:2] == [3, 4]


def test_a_child_of_an_evicted_and_reused_block_is_not_served(monkeypatch):
    monkeypatch.setattr(prefix_hash, "hash_block_tokens", lambda parent, tokens: b"same")
    manager = KVCacheManager(num_blocks=2, block_size=2, enable_prefix_caching=True)
    admit(manager, a := Request("a", [1, 1, 2, 2]))
    finish(manager, a)
    first, second = manager.pool.blocks[0], manager.pool.blocks[1]
    manager.pool.touch([second])
    manager.pool.release([second])  # make the first block the least recently used
    admit(manager, b := Request("b", [5, 5]))
    finish(manager, b)  # block 0 now holds [5, 5]; block 1 still names it as its parent
    assert first.cache_tokens == (5, 5)
    assert second.cache_tokens == (2, 2) and second.cache_parent is first
    assert manager.find_cached_prefix(Request("c", [5, 5, 2, 2, 0])).num_tokens == 2


def test_duplicates_of_a_block_coexist_and_survive_each_other():
    manager = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a, b = Request("a", [1, 1, 0]), Request("b", [1, 1, 0])
    # Both admitted before either computed: each fills its own copy of [1, 1].
    manager.allocate_slots(a, 3)
    manager.allocate_slots(b, 3)
    a.num_computed_tokens = b.num_computed_tokens = 3
    finish(manager, a)
    finish(manager, b)
    assert len(manager.pool.cached_blocks(manager.pool.blocks[0].block_hash)) == 2
    manager.pool.take(manager.pool.num_free_blocks - 1)  # evicts a's copy, keeps b's
    hit = manager.find_cached_prefix(Request("c", [1, 1, 5]))
    assert hit.num_tokens == 2 and hit.blocks[0].block_id == 2


def test_caching_disabled_means_no_hashes_and_no_hits():
    manager = KVCacheManager(num_blocks=8, block_size=2)
    admit(manager, a := Request("a", [1, 2, 3, 4, 5]))
    finish(manager, a)
    assert manager.find_cached_prefix(Request("b", [1, 2, 3, 4, 5])) is not None
    assert manager.find_cached_prefix(Request("b", [1, 2, 3, 4, 5])).num_tokens == 0
    assert not any(blk.is_cached for blk in manager.pool.blocks) and not a.block_hashes
    assert manager.stats().prefix_cache_queries == 0


def test_stale_hits_are_refused():
    manager = KVCacheManager(num_blocks=2, block_size=2, enable_prefix_caching=True)
    admit(manager, a := Request("a", [1, 1, 0]))
    finish(manager, a)
    b = Request("b", [1, 1, 2])
    hit = manager.find_cached_prefix(b)
    manager.pool.take(2)  # evicts the hit block
    with pytest.raises(ValueError, match="stale"):
        manager.allocate_slots(b, 1, hit)


def test_reset_prefix_cache():
    manager = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    admit(manager, a := Request("a", [1, 1, 0]))
    a.append_token(3)
    manager.allocate_slots(a, 1)
    assert not manager.reset_prefix_cache()  # a still holds blocks
    finish(manager, a)
    assert manager.reset_prefix_cache()
    assert manager.find_cached_prefix(Request("b", [1, 1, 0])).num_tokens == 0
    assert manager.stats().num_cached_free_blocks == 0
