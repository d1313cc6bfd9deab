"""KV memory planning: blocks from a budget, the fits check, the manager a layout asks for."""

from __future__ import annotations

import pytest

from pagedllm.config import EngineConfig
from pagedllm.core.kv import ContiguousKVManager, KVCacheManager
from pagedllm.core.kv.plan import describe_plan, make_kv_manager, plan_kv_cache


def test_a_byte_budget_buys_whole_blocks():
    plan = plan_kv_cache(EngineConfig(kv_cache_memory=10_000, block_size=8), bytes_per_block=1_000,
                         model_max_len=32)
    assert (plan.num_blocks, plan.block_size, plan.kv_cache_bytes, plan.num_slots) == (10, 8, 10_000, 80)


def test_a_block_budget_overrides_the_byte_budget():
    config = EngineConfig(kv_cache_memory="1GiB", num_kv_blocks=6, block_size=4)
    assert plan_kv_cache(config, bytes_per_block=512, model_max_len=24).num_blocks == 6


def test_a_budget_too_small_for_one_max_model_len_request_is_refused():
    with pytest.raises(ValueError, match="max_model_len=33 needs 5 blocks .* holds only 4 blocks"):
        plan_kv_cache(EngineConfig(num_kv_blocks=4, block_size=8, max_model_len=33), bytes_per_block=100,
                      model_max_len=64)


def test_the_layout_picks_the_manager():
    plan = plan_kv_cache(EngineConfig(num_kv_blocks=4, block_size=8), 100, model_max_len=32)
    paged = make_kv_manager(EngineConfig(block_size=8), plan)
    assert isinstance(paged, KVCacheManager) and paged.enable_prefix_caching
    assert (paged.num_blocks, paged.block_size, paged.bytes_per_block) == (4, 8, 100)
    contiguous = make_kv_manager(EngineConfig(block_size=8, kv_layout="contiguous",
                                              contiguous_reserve="request"), plan)
    assert isinstance(contiguous, ContiguousKVManager) and contiguous.reserve == "request"
    assert contiguous.max_model_len == 32


def test_the_start_up_line_says_how_many_long_requests_fit():
    plan = plan_kv_cache(EngineConfig(num_kv_blocks=8, block_size=4), 2**20, model_max_len=8)
    line = describe_plan(plan, "float32", "paged")
    assert line == ("KV cache: 8 blocks x 4 tokens, 1048576 bytes per block, 32 token slots "
                    "(8.0 MiB, KV dtype float32, paged layout); max_model_len=8 fits 4 requests at once")


def test_an_unset_max_model_len_is_the_longest_request_the_budget_holds():
    config = EngineConfig(num_kv_blocks=5, block_size=8)
    plan = plan_kv_cache(config, bytes_per_block=100, model_max_len=1000)
    assert (plan.max_model_len, plan.model_max_len, plan.fitted) == (40, 1000, True)
    line = describe_plan(plan, "float32", "paged")
    assert "max_model_len=40 (the longest request this KV budget holds; the model allows 1000" in line
    assert line.endswith("fits 1 requests at once")
    roomy = plan_kv_cache(EngineConfig(num_kv_blocks=500, block_size=8), 100, model_max_len=1000)
    assert (roomy.max_model_len, roomy.fitted) == (1000, False)  # never above the model's limit
    assert "the model allows" not in describe_plan(roomy, "float32", "paged")
    with pytest.raises(ValueError, match="holds no KV block"):
        plan_kv_cache(EngineConfig(kv_cache_memory=99, block_size=8), 100, model_max_len=1000)


def test_a_sliding_window_fits_the_model_limit_in_a_few_blocks_on_the_paged_layout_only():
    config = EngineConfig(num_kv_blocks=7, block_size=8, max_num_batched_tokens=16)
    plan = plan_kv_cache(config, 100, model_max_len=1_000_000, sliding_window=32)
    # A 16-token chunk and the 31 keys before it span cdiv(46, 8) + 1 = 7 blocks.
    assert (plan.max_model_len, plan.blocks_per_request, plan.sliding_window) == (1_000_000, 7, 32)
    assert "its 32-token sliding window holding at most 7 blocks" in describe_plan(plan, "bf16", "paged")
    manager = make_kv_manager(config, plan)
    assert manager.sliding_window == 32
    contiguous = EngineConfig(num_kv_blocks=7, block_size=8, max_num_batched_tokens=16,
                              kv_layout="contiguous")
    plan = plan_kv_cache(contiguous, 100, model_max_len=1_000_000, sliding_window=32)
    assert (plan.max_model_len, plan.sliding_window) == (56, None)  # it cannot free
    # Four blocks cannot hold even one decode's window (31 keys before it span 5 blocks).
    with pytest.raises(ValueError, match="max_model_len=57 needs 8 blocks"):
        plan_kv_cache(EngineConfig(num_kv_blocks=4, block_size=8, max_model_len=57,
                                   max_num_batched_tokens=64), 100, 1000, sliding_window=32)


def test_a_window_plan_sizes_a_request_by_window_plus_step_not_by_length():
    """Issue 32, finding 2: 16 blocks of 8 and a 32-token window hold any length once a request's
    step is cut to what they hold: 90 new tokens + 31 older keys span cdiv(120, 8) + 1 = 16."""
    config = EngineConfig(num_kv_blocks=16, block_size=8, max_model_len=2100, max_num_batched_tokens=2100)
    plan = plan_kv_cache(config, 100, model_max_len=4096, sliding_window=32)
    assert (plan.max_model_len, plan.blocks_per_request) == (2100, 16)
    manager = make_kv_manager(config, plan)
    assert manager.max_step_tokens == 90
    assert manager.max_tokens_per_request(2100) > 2100  # any length runs alone
    # Mixed-window models (no kv_window) are sized by their length, as before.
    with pytest.raises(ValueError, match="max_model_len=2100 needs 263 blocks"):
        plan_kv_cache(config, 100, model_max_len=4096, sliding_window=None)
