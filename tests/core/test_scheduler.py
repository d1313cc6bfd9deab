from __future__ import annotations

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv import ContiguousKVManager, KVCacheManager
from pagedllm.core.kv.slots import request_slots
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.sampling_params import SamplingParams
from tests.core.kv.sim import SimRunner, check_output, check_scheduler

EOS = 0


def make(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
         max_num_batched_tokens: int = 64, max_model_len: int = 64,
         prefix_caching: bool = False, step_share_tokens: int | None = None) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len,
                             step_share_tokens=step_share_tokens)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, prefix_caching))


def req(request_id: str, num_tokens: int, max_tokens: int | None = 16, first: int = 1,
        **params) -> Request:
    return Request(request_id, list(range(first, first + num_tokens)),
                   SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=(EOS,))


def step(scheduler: Scheduler, token: int = 7, runner: SimRunner | None = None,
         tokens: dict[str, int] | None = None) -> SchedulerOutput:
    """schedule, (simulated) run, update: every sampling request gets `token`."""
    out = scheduler.schedule()
    check_output(scheduler, out)
    if runner is not None:
        runner.execute(out)
    sampled = {s.request.request_id: (tokens or {}).get(s.request.request_id, token)
               for s in out.scheduled if s.samples}
    scheduler.update_from_output(out, sampled)
    check_scheduler(scheduler)
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


# -- admission and budgets -----------------------------------------------------------------

def test_short_prompts_all_run_in_one_step_in_order():
    scheduler = make()
    for i, n in enumerate([5, 3, 8]):
        scheduler.add_request(req(f"r{i}", n))
    assert scheduler.num_waiting == 3 and scheduler.has_unfinished_requests()
    out = step(scheduler)
    assert plan(out) == [("r0", 5), ("r1", 3), ("r2", 8)]
    assert out.num_batched_tokens == 16 and all(s.samples for s in out.scheduled)
    assert scheduler.num_running == 3 and scheduler.num_waiting == 0
    assert plan(step(scheduler)) == [("r0", 1), ("r1", 1), ("r2", 1)]  # decodes


def test_max_num_seqs_caps_the_batch():
    scheduler = make(max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(req(f"r{i}", 2))
    assert plan(step(scheduler)) == [("r0", 2), ("r1", 2)]
    assert scheduler.num_waiting == 1


def test_chunked_prefill_splits_a_long_prompt_by_the_budget():
    scheduler = make(num_blocks=512, max_num_batched_tokens=400, max_model_len=2048)
    scheduler.add_request(req("long", 1024))
    chunks = [plan(step(scheduler)) for _ in range(3)]
    assert chunks == [[("long", 400)], [("long", 400)], [("long", 224)]]
    assert scheduler.get_request("long").num_output_tokens == 1  # sampled after the last chunk


def test_prefill_chunks_and_decodes_share_a_step():
    scheduler = make(num_blocks=256, max_num_batched_tokens=10, max_model_len=256)
    scheduler.add_request(req("a", 4))
    step(scheduler)
    scheduler.add_request(req("b", 30))
    scheduler.add_request(req("c", 30))
    assert plan(step(scheduler)) == [("a", 1), ("b", 9)]
    out = step(scheduler)
    assert plan(out) == [("a", 1), ("b", 9)]
    assert [s.samples for s in out.scheduled] == [True, False]
    assert plan(step(scheduler)) == [("a", 1), ("b", 9)]
    assert plan(step(scheduler)) == [("a", 1), ("b", 3), ("c", 6)]  # two partial prefills


def test_the_head_of_the_queue_is_not_skipped():
    scheduler = make(num_blocks=4, block_size=4, max_model_len=16)
    scheduler.add_request(req("small", 4, max_tokens=4))
    step(scheduler)  # small holds 1 block (2 after its next decode)
    scheduler.add_request(req("big", 12, max_tokens=4))  # needs 3 blocks now
    scheduler.add_request(req("tiny", 1, max_tokens=1))  # would fit
    out = step(scheduler)
    assert plan(out) == [("small", 1)]  # tiny waits behind big
    assert [r.request_id for r in scheduler.waiting] == ["big", "tiny"]


def test_a_request_is_never_scheduled_for_zero_tokens():
    scheduler = make(max_num_batched_tokens=3)
    scheduler.add_request(req("a", 3))
    scheduler.add_request(req("b", 2))
    assert plan(step(scheduler)) == [("a", 3)]  # budget spent: b waits for the next step


# -- refusals -----------------------------------------------------------------------------

def test_refusals_say_what_is_wrong():
    scheduler = make(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="'e' has 0 prompt tokens; .* 1 to max_model_len=32"):
        scheduler.add_request(Request("e", []))
    with pytest.raises(ValueError, match="'long' has 33 prompt tokens; .* 1 to max_model_len=32"):
        scheduler.add_request(req("long", 33))
    with pytest.raises(ValueError, match="needs up to 20 tokens .* holds 16"):
        scheduler.add_request(req("big", 10, max_tokens=10))
    with pytest.raises(ValueError, match="needs up to 32 tokens"):
        scheduler.add_request(req("unbounded", 1, max_tokens=None))
    scheduler.add_request(req("ok", 10, max_tokens=6))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(req("ok", 1))
    assert scheduler.num_waiting == 1


def test_a_contiguous_cache_too_small_for_one_reservation_refuses_everything():
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    scheduler = Scheduler(config, ContiguousKVManager(8, 4, max_model_len=64))
    with pytest.raises(ValueError, match="holds 0"):
        scheduler.add_request(req("a", 1, max_tokens=1))


# -- stops ---------------------------------------------------------------------------------

def run_one(request: Request, tokens: list[int], max_model_len: int = 64) -> list[int]:
    scheduler = make(max_model_len=max_model_len)
    scheduler.add_request(request)
    for token in tokens:
        if request.is_finished:
            break
        step(scheduler, token)
    return request.output_token_ids


def test_eos_stops_unless_ignored():
    stopped = req("a", 3)
    assert run_one(stopped, [5, EOS, 6]) == [5, EOS]
    assert stopped.status is RequestStatus.FINISHED_STOPPED and stopped.stop_reason is None
    ignored = req("b", 3, ignore_eos=True, max_tokens=3)
    assert run_one(ignored, [EOS, EOS, EOS, EOS]) == [EOS, EOS, EOS]
    assert ignored.status is RequestStatus.FINISHED_LENGTH


def test_every_eos_id_stops():
    for eos in (7, 8):
        request = Request("r", [1, 2], SamplingParams(max_tokens=5), eos_token_ids=(7, 8))
        assert run_one(request, [5, eos, 6]) == [5, eos]
        assert request.status is RequestStatus.FINISHED_STOPPED and request.stop_reason is None


def test_stop_token_ids_and_min_tokens():
    stop = req("a", 3, stop_token_ids=[42])
    assert run_one(stop, [5, 42, 6]) == [5, 42] and stop.stop_reason == 42
    early = req("b", 3, min_tokens=3, stop_token_ids=[42])
    assert run_one(early, [EOS, 42, 42, 9]) == [EOS, 42, 42]
    assert early.status is RequestStatus.FINISHED_STOPPED


def test_length_limits():
    capped = req("a", 3, max_tokens=2)
    assert run_one(capped, [5] * 5) == [5, 5] and capped.status is RequestStatus.FINISHED_LENGTH
    by_context = req("b", 6, max_tokens=None)
    assert run_one(by_context, [5] * 5, max_model_len=8) == [5, 5]
    assert by_context.status is RequestStatus.FINISHED_LENGTH and by_context.num_tokens == 8


def test_finished_requests_give_their_blocks_back_at_once():
    scheduler = make()
    scheduler.add_request(a := req("a", 5, max_tokens=1))
    out = scheduler.schedule()
    finished = scheduler.update_from_output(out, {"a": 3})
    assert finished == [a] and scheduler.kv_manager.stats().num_free_blocks == 64
    assert scheduler.num_running == 0 and not scheduler.has_unfinished_requests()
    assert scheduler.schedule().finished == [a]  # reported once, to the runner
    assert scheduler.schedule().finished == []


# -- preemption -----------------------------------------------------------------------------

def test_preemption_takes_the_newest_and_resumes_it_with_all_its_tokens():
    # 4 blocks of 2 tokens: a and b hold 2 blocks each after their prompts.
    scheduler = make(num_blocks=4, block_size=2, max_model_len=8)
    runner = SimRunner(4, 2)
    scheduler.add_request(a := req("a", 3, max_tokens=5, ignore_eos=True))
    scheduler.add_request(b := req("b", 3, max_tokens=5, first=10, ignore_eos=True))
    step(scheduler, runner=runner)  # both prefilled, each sampled one token
    out = step(scheduler, runner=runner)  # 4 tokens each now: still 2 blocks each
    out = step(scheduler, runner=runner)  # a needs a third block: b goes
    assert out.preempted == [b] and plan(out) == [("a", 1)]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and scheduler.num_preemptions == 1
    assert list(scheduler.waiting) == [b] and b.output_token_ids == [7, 7]
    while not a.is_finished:
        step(scheduler, runner=runner)
    out = step(scheduler, runner=runner)
    assert plan(out) == [("b", 5)]  # recomputed as a prompt: 3 + its 2 outputs
    while not b.is_finished:
        step(scheduler, runner=runner)
    assert b.output_token_ids == [7] * 5 and not scheduler.has_unfinished_requests()


def test_no_admissions_in_a_step_that_preempted():
    scheduler = make(num_blocks=4, block_size=2, max_model_len=8)
    scheduler.add_request(req("a", 3, max_tokens=5))
    scheduler.add_request(req("b", 3, max_tokens=5))
    step(scheduler)
    step(scheduler)
    scheduler.add_request(req("c", 1, max_tokens=1))
    out = step(scheduler)
    assert [r.request_id for r in out.preempted] == ["b"] and plan(out) == [("a", 1)]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]


def test_a_request_that_preempts_itself_runs_again_later():
    scheduler = make(num_blocks=3, block_size=2, max_model_len=6)
    scheduler.add_request(a := req("a", 1, max_tokens=3))
    scheduler.add_request(b := req("b", 4, max_tokens=2))
    step(scheduler)  # a: 1 block, b: 2 blocks; the cache is full
    out = step(scheduler)  # a's token fits its block; b, the newest, needs one: b goes
    assert out.preempted == [b] and plan(out) == [("a", 1)]
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert a.is_finished and b.is_finished


def test_preempted_requests_can_hit_their_own_blocks():
    scheduler = make(num_blocks=4, block_size=2, max_model_len=8, prefix_caching=True)
    runner = SimRunner(4, 2)
    scheduler.add_request(a := req("a", 3, max_tokens=3, ignore_eos=True))
    scheduler.add_request(b := req("b", 4, max_tokens=4, first=10, ignore_eos=True))
    step(scheduler, runner=runner)
    out = step(scheduler, runner=runner)
    assert out.preempted == [b]  # its two computed blocks stay cached while free
    while not a.is_finished:
        step(scheduler, runner=runner)  # a's third block evicts b's tail block only
    out = step(scheduler, runner=runner)
    (resumed,) = out.scheduled
    assert resumed.request is b and resumed.num_computed_tokens == 2  # its own first block
    assert resumed.num_computed_tokens + resumed.num_new_tokens == 5  # prompt + 1 output


# -- prefix hits through the scheduler ---------------------------------------------------

def test_a_prefix_hit_is_scheduled_as_computed_tokens():
    scheduler = make(num_blocks=32, block_size=4, prefix_caching=True)
    runner = SimRunner(32, 4)
    scheduler.add_request(req("a", 10, max_tokens=2))
    step(scheduler, runner=runner)
    step(scheduler, runner=runner)  # a's 2 full prompt blocks are cached by now
    scheduler.add_request(req("b", 11, max_tokens=1))
    out = step(scheduler, runner=runner)
    (b_step,) = [s for s in out.scheduled if s.request.request_id == "b"]
    assert (b_step.num_computed_tokens, b_step.num_new_tokens) == (8, 3)
    assert b_step.request.num_cached_tokens == 8  # the hit, as the scheduler counted it
    assert request_slots(b_step.block_ids, 8, 11, 4) == [b_step.block_ids[2] * 4 + i for i in range(3)]
    stats = scheduler.kv_manager.stats()
    assert stats.prefix_cache_hits == 8 and stats.prefix_cache_queries == 21


# -- from outside: abort, finish, fork ------------------------------------------------------

def test_abort_in_every_state():
    scheduler = make(num_blocks=4, block_size=2, max_model_len=8)
    scheduler.add_request(running := req("running", 3, max_tokens=5))
    scheduler.add_request(preempted := req("preempted", 3, max_tokens=5))
    step(scheduler)
    step(scheduler)
    step(scheduler)
    assert preempted.status is RequestStatus.PREEMPTED
    scheduler.add_request(waiting := req("waiting", 2, max_tokens=2))
    for request in (waiting, preempted, running):
        assert scheduler.abort_request(request.request_id) is request
        assert request.status is RequestStatus.FINISHED_ABORTED
        assert scheduler.kv_manager.block_ids(request) == []
        check_scheduler(scheduler)
    assert scheduler.abort_request("running") is None  # finished already
    assert scheduler.abort_request("unknown") is None
    assert scheduler.kv_manager.stats().num_free_blocks == 4
    assert set(scheduler.schedule().finished) == {waiting, preempted, running}


def test_a_request_aborted_mid_step_ignores_that_steps_output():
    scheduler = make()
    scheduler.add_request(a := req("a", 4))
    out = scheduler.schedule()
    scheduler.abort_request("a")
    assert scheduler.update_from_output(out, {"a": 5}) == []
    assert a.output_token_ids == [] and a.status is RequestStatus.FINISHED_ABORTED


def test_finish_requests_from_outside():
    scheduler = make()
    scheduler.add_request(a := req("a", 4))
    scheduler.add_request(b := req("b", 4))
    step(scheduler)
    done = scheduler.finish_requests(["a", "b", "a", "nope"], RequestStatus.FINISHED_STOPPED)
    assert done == [a, b] and not scheduler.has_unfinished_requests()
    with pytest.raises(ValueError, match="finished status"):
        scheduler.finish_requests("a", RequestStatus.RUNNING)


def test_fork_shares_blocks_and_runs_right_after_the_parent():
    scheduler = make(num_blocks=16, block_size=4)
    runner = SimRunner(16, 4)
    scheduler.add_request(parent := req("p", 6, max_tokens=4))
    scheduler.add_request(other := req("o", 2, max_tokens=4))
    step(scheduler, runner=runner, tokens={"p": 11})
    child = Request("p#1", parent.prompt_token_ids, parent.sampling_params, eos_token_ids=(EOS,))
    child.append_token(22)  # another sample from the same logits
    scheduler.fork_request(parent, child)
    assert scheduler.running == [parent, child, other]
    assert scheduler.kv_manager.block_ids(child) == scheduler.kv_manager.block_ids(parent)
    assert child.num_computed_tokens == 6 and child.block_hashes == parent.block_hashes[:1]
    out = step(scheduler, runner=runner)
    assert plan(out) == [("p", 1), ("p#1", 1), ("o", 1)]
    assert len(out.block_copies) == 1  # the parent copied the shared partial block
    assert child.output_token_ids == [22, 7] and parent.output_token_ids == [11, 7]


def test_fork_refuses_what_cannot_share():
    scheduler = make()
    scheduler.add_request(parent := req("p", 4))
    with pytest.raises(ValueError, match="running"):
        scheduler.fork_request(parent, req("c", 4))
    step(scheduler)
    with pytest.raises(ValueError, match="computed tokens"):
        scheduler.fork_request(parent, req("c", 4, first=50))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.fork_request(parent, req("p", 5))


def test_a_contiguous_fork_without_room_is_recomputed_later():
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=8)
    scheduler = Scheduler(config, ContiguousKVManager(2, 4, max_model_len=8))
    scheduler.add_request(parent := req("p", 3, max_tokens=2))
    step(scheduler)
    child = Request("c", parent.prompt_token_ids, parent.sampling_params)
    child.append_token(9)
    scheduler.fork_request(parent, child)
    assert list(scheduler.waiting) == [child] and child.num_computed_tokens == 0
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert child.output_token_ids == [9, 7]


def test_scheduled_request_views():
    scheduler = make(block_size=4)
    scheduler.add_request(req("a", 6))
    out = scheduler.schedule()
    (item,) = out.scheduled
    assert request_slots(item.block_ids, item.num_computed_tokens, item.num_context_tokens, 4) == \
        [0, 1, 2, 3, 4, 5] and item.samples
    assert item.block_ids is scheduler.kv_manager.block_ids(item.request)
    assert item.request.num_cached_tokens == 0 and item.request.first_scheduled_time is not None
    scheduler.update_from_output(out, {"a": 1})
    assert item.samples  # fixed when scheduled, not changed by the appended token


def test_a_missing_sample_is_an_error_not_a_stuck_request():
    scheduler = make()
    scheduler.add_request(req("a", 3))
    with pytest.raises(ValueError, match="no sampled token"):
        scheduler.update_from_output(scheduler.schedule(), {})


def test_the_overhead_benchmark_runs_and_reports(tmp_path, capsys):
    from pagedllm.bench import scheduler_overhead

    report = scheduler_overhead.run(num_requests=4, context_lens=(16, 64), block_size=4, steps=6,
                                    prefix_caching=True)
    assert [r["context_len"] for r in report["results"]] == [16, 64]
    assert all(r["num_preemptions"] == 0 and r["total"]["p50_us"] > 0 for r in report["results"])
    path = tmp_path / "overhead.json"
    assert scheduler_overhead.main(["--num-requests", "2", "--context-lens", "8,32", "--steps",
                                    "3", "--output-json", str(path)]) == 0
    assert "context" in capsys.readouterr().out and path.exists()
