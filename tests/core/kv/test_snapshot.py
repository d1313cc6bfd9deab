"""The dashboard's block map, state by state, on small caches where every block is known.
(tests/core/kv/test_properties.py checks it against the managers' figures after every random step.)"""

from __future__ import annotations

from pagedllm.core.kv import ContiguousKVManager, KVCacheManager
from pagedllm.core.kv.snapshot import STATE_NAMES, BlockMap, runs
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams
from tests.core.kv.sim import check_block_map


def req(request_id: str, num_tokens: int, max_tokens: int | None = None) -> Request:
    return Request(request_id, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=max_tokens))


def compute(request: Request, manager, num_new: int) -> None:
    assert manager.allocate_slots(request, num_new)
    request.num_computed_tokens += num_new


def states(picture: BlockMap) -> list[str]:
    return [STATE_NAMES[code] for code in picture.states]


def test_runs_compress_consecutive_ids():
    assert runs([]) == []
    assert runs([3]) == [(3, 1)]
    assert runs([5, 6, 7, 10, 11, 2]) == [(5, 3), (10, 2), (2, 1)]


def test_an_empty_cache_is_all_free():
    picture = KVCacheManager(num_blocks=6, block_size=4).block_map()
    assert states(picture) == ["free"] * 6
    assert picture.counts() == {"free": 6, "used": 0, "shared": 0, "cached": 0, "copying": 0}
    assert picture.owners == {} and picture.filled == bytes(6)


def test_paged_blocks_go_used_shared_copying_then_cached():
    manager = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    parent = req("p", 6)
    compute(parent, manager, 6)  # block 0 full, block 1 holds 2 of 4
    picture = manager.block_map()
    assert states(picture)[:3] == ["used", "used", "free"]
    assert list(picture.filled[:2]) == [4, 2] and picture.owners == {"p": [(0, 2)]}

    child = Request("p#1", parent.prompt_token_ids)
    child.num_computed_tokens = 6
    parent.append_token(100)
    child.append_token(200)
    manager.fork(parent, child)
    picture = manager.block_map()
    assert states(picture)[:2] == ["shared", "shared"] and list(picture.ref_counts[:2]) == [2, 2]
    assert picture.owners == {"p": [(0, 2)], "p#1": [(0, 2)]}
    check_block_map(manager)

    compute(parent, manager, 1)  # writes the shared partial block 1: copied into block 2
    assert states(manager.block_map())[:3] == ["shared", "used", "copying"]  # pending
    assert manager.take_block_copies() == [(1, 2)]  # the step takes it: still this step's copy
    picture = manager.block_map()
    assert states(picture)[:3] == ["shared", "used", "copying"]
    assert picture.owners == {"p": [(0, 1), (2, 1)], "p#1": [(0, 2)]}
    check_block_map(manager)
    manager.take_block_copies()  # the next step copies nothing
    assert states(manager.block_map())[2] == "used"

    manager.free(child)
    manager.free(parent)  # block 0 was computed by both: it stays cached for reuse
    picture = manager.block_map()
    assert states(picture)[:3] == ["cached", "free", "free"] and picture.filled[0] == 4
    assert picture.owners == {}
    check_block_map(manager)


def test_contiguous_reservations_are_used_and_filled_from_the_front():
    manager = ContiguousKVManager(num_blocks=8, block_size=4, max_model_len=16, reserve="request")
    a, b = req("a", 5, max_tokens=7), req("b", 3, max_tokens=1)
    compute(a, manager, 5)  # reserves 12 tokens: blocks 0-2, 5 tokens used
    compute(b, manager, 3)  # reserves 4 tokens: block 3
    picture = manager.block_map()
    assert states(picture) == ["used"] * 4 + ["free"] * 4
    assert list(picture.filled) == [4, 1, 0, 3, 0, 0, 0, 0]  # block 2 reserved but empty
    assert picture.owners == {"a": [(0, 3)], "b": [(3, 1)]}
    check_block_map(manager)

    child = Request("a#1", a.prompt_token_ids, a.sampling_params)
    child.num_computed_tokens = 5
    child.append_token(7)
    manager.fork(a, child)  # a run of its own, the used blocks copied into it
    assert states(manager.block_map())[4:8] == ["copying", "copying", "used", "free"]
    check_block_map(manager)


def test_the_dict_form_is_plain_json_and_round_trips():
    import json

    manager = KVCacheManager(num_blocks=300, block_size=16)
    for i in range(3):
        compute(req(f"r{i}", 40), manager, 40)
    picture = manager.block_map()
    encoded = json.dumps(picture.to_dict())
    assert BlockMap.from_dict(json.loads(encoded)) == picture
    assert len(encoded) < 3 * 4 * 300 // 3 + 200  # three base64 bytes per block and the owners
