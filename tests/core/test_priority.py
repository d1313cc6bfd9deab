"""Priority scheduling (issue 37): the waiting queue in (priority, arrival) order, a better priority
preempting a worse one for blocks, seats and step tokens in the step it arrives, fcfs refusing a
priority; and, for any mix of arrivals and priorities (property test), the queues' order, no
waiting request outranking a running one after a schedule, and every request finishing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv import KVCacheManager
from pagedllm.core.priority import WaitingQueue, check_priority
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from tests.core.kv.sim import SimRunner
from tests.core.test_scheduler import EOS, plan, step


def make(policy: str = "priority", num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
         max_num_batched_tokens: int = 64, max_model_len: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, policy)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, False))


def req(request_id: str, num_tokens: int, priority: int = 0, max_tokens: int = 8,
        first: int = 1) -> Request:
    return Request(request_id, list(range(first, first + num_tokens)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_ids=(EOS,),
                   priority=priority)


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def test_the_waiting_queue_is_in_priority_then_arrival_order():
    queue = WaitingQueue()
    for name, p in [("a", 5), ("b", 0), ("c", 5), ("d", -1), ("e", 0)]:
        queue.add(req(name, 1, p))
    assert ids(queue) == ["d", "b", "e", "a", "c"]
    queue.add_front(preempted := req("p", 1, 5))  # older than those that never ran
    assert ids(queue) == ["d", "b", "e", "p", "a", "c"]
    queue.remove(preempted)
    queue.remove_all({id(r) for r in queue if r.priority == 0})
    assert ids(queue) == ["d", "a", "c"] and len(queue) == 3 and queue[0].request_id == "d"


def test_fcfs_refuses_a_priority_naming_the_flag_and_priority_bounds_it():
    check_priority("fcfs", 0)
    check_priority("priority", -(2**63))
    with pytest.raises(ValueError, match=r"priority 3 needs --scheduling-policy priority .*fcfs"):
        check_priority("fcfs", 3)
    for bad in (2**63, True, 1.5, "1"):
        with pytest.raises(ValueError, match="priority must be an integer in"):
            check_priority("priority", bad)
    scheduler = make("fcfs")
    with pytest.raises(ValueError, match="'r': priority -1 needs --scheduling-policy priority"):
        scheduler.add_request(req("r", 3, -1))
    assert not scheduler.has_unfinished_requests()


def test_a_better_priority_is_admitted_first_and_runs_first():
    scheduler = make(max_num_seqs=2)
    for name, p in [("low", 9), ("mid", 5), ("high", 1)]:
        scheduler.add_request(req(name, 2, p))
    out = step(scheduler)
    assert plan(out) == [("high", 2), ("mid", 2)] and ids(scheduler.waiting) == ["low"]


def fill_with_low_priority(scheduler: Scheduler, runner: SimRunner, count: int) -> list[Request]:
    low = [req(f"low{i}", 5, priority=10, max_tokens=20, first=100 + 10 * i) for i in range(count)]
    for r in low:
        scheduler.add_request(r)
    for _ in range(3):
        step(scheduler, runner=runner)
    assert scheduler.num_running == count and scheduler.num_waiting == 0
    return low


def test_a_better_priority_preempts_for_blocks_and_runs_in_the_step_it_arrives():
    # 32 priority-10 requests of 8 tokens hold 64 of 66 blocks of 4 tokens; they grow to 25.
    scheduler = make(num_blocks=66, max_num_seqs=64, max_num_batched_tokens=256, max_model_len=32)
    runner = SimRunner(66, 4)
    low = fill_with_low_priority(scheduler, runner, 32)
    preempted_in_all: list[Request] = []
    stream = []
    for i in range(6):  # a stream of priority-0 requests, one a step
        scheduler.add_request(high := req(f"high{i}", 6, priority=0, max_tokens=3, first=1 + i))
        stream.append(high)
        out = step(scheduler, runner=runner)
        assert (f"high{i}", 6) in plan(out), "it did not run in the step it arrived"
        assert high.num_output_tokens == 1  # its first token, in that same step
        preempted_in_all += out.preempted
        assert all(r.priority == 10 for r in out.preempted)
    assert preempted_in_all, "the cache was full: someone had to go"
    while scheduler.has_unfinished_requests():
        step(scheduler, runner=runner)
    assert all(r.num_output_tokens == 3 for r in stream)
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 20 for r in low)


def test_a_better_priority_takes_a_seat_and_step_tokens_from_a_worse_one():
    # Seats: max_num_seqs 4, all running priority 10. Tokens: the step's 4 all spent by them.
    scheduler = make(max_num_seqs=4, max_num_batched_tokens=4, max_model_len=32)
    runner = SimRunner(64, 4)
    for i in range(4):
        scheduler.add_request(req(f"low{i}", 1, priority=10, max_tokens=20, first=10 + i))
    step(scheduler, runner=runner)
    scheduler.add_request(req("high", 1, priority=0, max_tokens=2))
    out = step(scheduler, runner=runner)
    assert ids(out.preempted) == ["low3"]  # the newest of the worst priority
    assert plan(out) == [("low0", 1), ("low1", 1), ("low2", 1), ("high", 1)]
    assert ids(scheduler.running) == ["high", "low0", "low1", "low2"]  # priority order


def test_equal_priorities_never_preempt_each_other_for_admission():
    scheduler = make(max_num_seqs=2)
    scheduler.add_request(req("a", 2, 3, max_tokens=20))
    scheduler.add_request(req("b", 2, 3, max_tokens=20))
    step(scheduler)
    scheduler.add_request(req("c", 2, 3))
    out = step(scheduler)
    assert out.preempted == [] and ids(scheduler.waiting) == ["c"]


def test_preemption_for_blocks_takes_the_worst_priority_not_the_newest():
    # 12 blocks of 2: a worse priority admitted first, a better one second; both grow.
    scheduler = make(num_blocks=12, block_size=2, max_model_len=24)
    runner = SimRunner(12, 2)
    scheduler.add_request(worse := req("worse", 3, priority=4, max_tokens=20))
    step(scheduler, runner=runner)
    scheduler.add_request(req("better", 3, priority=2, max_tokens=20, first=40))
    while not (out := step(scheduler, runner=runner)).preempted:
        pass
    assert out.preempted == [worse]


def test_with_every_priority_0_the_priority_policy_schedules_as_fcfs():
    steps = {}
    for policy in ("fcfs", "priority"):
        scheduler = make(policy, num_blocks=10, block_size=2, max_num_seqs=3, max_model_len=20)
        runner = SimRunner(10, 2)
        for i in range(6):
            scheduler.add_request(req(f"r{i}", 2 + i % 3, max_tokens=6, first=10 * i))
        trace = []
        while scheduler.has_unfinished_requests():
            out = step(scheduler, runner=runner)
            trace.append((plan(out), ids(out.preempted)))
        steps[policy] = trace
    assert steps["fcfs"] == steps["priority"]


@settings(max_examples=80, deadline=None)
@given(arrivals=st.lists(st.tuples(st.integers(0, 12), st.integers(-2, 2), st.integers(1, 9),
                                   st.integers(1, 12), st.integers(1, 3)), min_size=1, max_size=12),
       num_blocks=st.integers(10, 40), max_num_seqs=st.integers(1, 6),
       max_num_batched_tokens=st.integers(8, 32))
def test_any_mix_of_priorities_keeps_the_order_and_finishes(arrivals, num_blocks, max_num_seqs,
                                                             max_num_batched_tokens):
    """Requests (arrival step, priority, prompt, max_tokens, n) arriving at various steps, forked
    into n sequences at their first token: after every step both queues are in priority order and
    no waiting request has a better priority than a running one; the scheduler's invariants hold
    (step() checks them); every sequence finishes with all its tokens."""
    scheduler = make(num_blocks=num_blocks, block_size=4, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max_num_batched_tokens, max_model_len=24)
    runner = SimRunner(num_blocks, 4)
    pending = sorted((a[0], i, a) for i, a in enumerate(arrivals))
    added: list[Request] = []
    forks_left: dict[str, int] = {}
    for steps in range(2000):
        while pending and pending[0][0] <= steps:
            _, i, (_, p, prompt, max_tokens, n) = pending.pop(0)
            scheduler.add_request(r := req(f"r{i}", prompt, p, max_tokens, first=1 + i))
            added.append(r)
            forks_left[r.request_id] = n - 1
        if not pending and not scheduler.has_unfinished_requests():
            break
        step(scheduler, runner=runner)
        waiting, running = [r.priority for r in scheduler.waiting], [r.priority for r in scheduler.running]
        assert waiting == sorted(waiting) and running == sorted(running)
        assert not waiting or not running or max(running) <= min(waiting)
        for parent in list(scheduler.running):
            for k in range(forks_left.pop(parent.request_id, 0) if parent.num_output_tokens else 0):
                scheduler.fork_request(parent, child := parent.fork(f"{parent.request_id}#{k + 1}", 9))
                added.append(child)
    assert not scheduler.has_unfinished_requests() and not pending
    for r in added:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == min(r.sampling_params.max_tokens, 24 - r.num_prompt_tokens)
