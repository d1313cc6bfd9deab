"""KV memory planning: blocks from a budget, the fits check, the manager a layout asks for."""

from __future__ import annotations

import pytest

from pagedllm.config import EngineConfig
from pagedllm.kv import ContiguousKVManager, KVCacheManager
from pagedllm.kv.plan import describe_plan, make_kv_manager, plan_kv_cache


def test_a_byte_budget_buys_whole_blocks():
    plan = plan_kv_cache(EngineConfig(kv_cache_memory=10_000, block_size=8), bytes_per_block=1_000,
                         max_model_len=32)
    assert (plan.num_blocks, plan.block_size, plan.kv_cache_bytes, plan.num_slots) == (10, 8, 10_000, 80)


def test_a_block_budget_overrides_the_byte_budget():
    config = EngineConfig(kv_cache_memory="1GiB", num_kv_blocks=6, block_size=4)
    assert plan_kv_cache(config, bytes_per_block=512, max_model_len=24).num_blocks == 6


def test_a_budget_too_small_for_one_max_model_len_request_is_refused():
    with pytest.raises(ValueError, match="max_model_len=33 needs 5 blocks .* holds only 4 blocks"):
        plan_kv_cache(EngineConfig(num_kv_blocks=4, block_size=8), bytes_per_block=100, max_model_len=33)


def test_the_layout_picks_the_manager():
    plan = plan_kv_cache(EngineConfig(num_kv_blocks=4, block_size=8), 100, max_model_len=32)
    paged = make_kv_manager(EngineConfig(block_size=8), plan)
    assert isinstance(paged, KVCacheManager) and paged.enable_prefix_caching
    assert (paged.num_blocks, paged.block_size, paged.bytes_per_block) == (4, 8, 100)
    contiguous = make_kv_manager(EngineConfig(block_size=8, kv_layout="contiguous",
                                              contiguous_reserve="request"), plan)
    assert isinstance(contiguous, ContiguousKVManager) and contiguous.reserve == "request"
    assert contiguous.max_model_len == 32


def test_the_start_up_line_says_how_many_long_requests_fit():
    plan = plan_kv_cache(EngineConfig(num_kv_blocks=8, block_size=4), 2**20, max_model_len=8)
    line = describe_plan(plan, "float32", "paged")
    assert line == ("KV cache: 8 blocks x 4 tokens, 1048576 bytes per block, 32 token slots "
                    "(8.0 MiB, KV dtype float32, paged layout); max_model_len=8 fits 4 requests at once")
