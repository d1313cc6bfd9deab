"""The scheduler's side of speculative decoding, with exact block ids: a proposal runs after the
known tokens and takes slots like them (copy-on-write first where a block is shared), is cut to the
budget, dropped before anyone is preempted, and after the step only accepted tokens count as
computed, the rejected ones' slots go back, and a stop inside an accepted run ends it there."""

from __future__ import annotations

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams


def make(num_blocks: int = 16, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(8, budget, 64), KVCacheManager(num_blocks, 4))


def prefilled(scheduler: Scheduler, request_id: str, prompt: list[int], first_token: int,
              max_tokens: int = 30, **params) -> Request:
    request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params))
    scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, {request_id: first_token})
    return request


def test_a_proposal_runs_after_the_known_token_and_rejected_slots_go_back():
    scheduler = make()
    request = prefilled(scheduler, "a", [1, 2, 3, 4, 5, 6], first_token=7)
    assert scheduler.kv_manager.block_ids(request) == [0, 1]
    request.spec_token_ids = [8, 9, 10, 11]
    out = scheduler.schedule()
    (item,) = out.scheduled
    assert (item.num_new_tokens, item.num_spec_tokens) == (5, 4)
    assert item.input_token_ids() == [7, 8, 9, 10, 11]
    assert scheduler.kv_manager.block_ids(request) == [0, 1, 2]  # positions 6 .. 10
    scheduler.update_from_output(out, {"a": [8, 9, 30]})  # two accepted, then the target's 30
    assert request.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 30]
    assert request.num_computed_tokens == 9 and request.spec_token_ids == []
    assert scheduler.kv_manager.block_ids(request) == [0, 1, 2]
    assert scheduler.kv_manager.pool.blocks[2].num_filled == 1  # position 8 kept, 9 and 10 back


def test_a_shared_block_is_copied_before_a_proposal_is_written_and_neither_writes_the_other():
    scheduler = make()
    parent = prefilled(scheduler, "p", [1, 2, 3, 4, 5, 6], first_token=7)
    child = parent.fork("p#1", 40)
    scheduler.fork_request(parent, child)
    assert scheduler.kv_manager.block_ids(child) == [0, 1]  # shared, tail half full
    child.spec_token_ids = [41, 42, 43]
    out = scheduler.schedule()
    # The parent, first in line, writes position 6 into its own copy of block 1; the child then
    # holds block 1 alone and writes positions 6 .. 9 into it and a new block 3.
    assert out.block_copies == [(1, 2)]
    assert scheduler.kv_manager.block_ids(parent) == [0, 2]
    assert scheduler.kv_manager.block_ids(child) == [0, 1, 3]
    assert [scheduler.kv_manager.pool.blocks[b].ref_cnt for b in (0, 1, 2, 3)] == [2, 1, 1, 1]
    scheduler.update_from_output(out, {"p": 8, "p#1": [44]})  # nothing of the child's accepted
    assert scheduler.kv_manager.block_ids(child) == [0, 1]
    assert scheduler.kv_manager.pool.blocks[1].num_filled == 3  # positions 4 .. 6 kept
    assert scheduler.kv_manager.block_ids(parent) == [0, 2]


def test_the_budget_cuts_a_proposal_and_short_blocks_drop_it_before_a_preemption():
    scheduler = make(budget=3)
    request = prefilled(scheduler, "a", [1, 2], first_token=3)
    request.spec_token_ids = [4, 5, 6, 7]
    out = scheduler.schedule()
    assert (out.scheduled[0].num_new_tokens, request.spec_token_ids) == (3, [4, 5])
    scheduler.update_from_output(out, {"a": [4, 5, 9]})
    full = make(num_blocks=3)
    a = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=7))
    b = Request("b", [1], SamplingParams(max_tokens=3))
    full.add_request(a)
    full.add_request(b)
    full.update_from_output(full.schedule(), {"a": 6, "b": 2})  # a: blocks 0, 1; b: block 2
    a.spec_token_ids = [7, 8, 9, 10]  # positions 5 .. 9 would need a fourth block
    out = full.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 1)]
    assert out.preempted == [] and a.spec_token_ids == [] and b.status is RequestStatus.RUNNING


def test_a_stop_inside_the_accepted_run_ends_the_request_there():
    scheduler = make()
    request = prefilled(scheduler, "a", [1, 2, 3], first_token=4, stop_token_ids=[6])
    request.spec_token_ids = [5, 6, 7]
    out = scheduler.schedule()
    finished = scheduler.update_from_output(out, {"a": [5, 6, 7, 8]})
    assert finished == [request] and request.status is RequestStatus.FINISHED_STOPPED
    assert request.token_ids == [1, 2, 3, 4, 5, 6] and request.stop_reason == 6
    assert scheduler.kv_manager.stats().num_free_blocks == 16
