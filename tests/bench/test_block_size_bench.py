"""The block-size sweep's accounting: budgets, time shares, and the call timer that measures them."""

import sys
import types

from pagedllm.bench import block_size as bench
from pagedllm.bench.common import CallTimer, RunResult, StepRecord, timed_functions
from pagedllm.kernels.attention import paged_attention


def test_the_token_budget_is_the_same_for_every_block_size():
    assert [bench.num_blocks_for(16384, bs) for bs in (8, 16, 128)] == [2048, 1024, 128]
    assert bench.num_blocks_for(1000, 64) == 15  # whole blocks only


def test_sweep_row_shares_are_of_the_run_elapsed_time():
    steps = [StepRecord(0.0, allocated_slots=100, used_slots=90, running=3, waiting=1),
             StepRecord(1.0, allocated_slots=200, used_slots=190, running=4, waiting=0)]
    result = RunResult(elapsed_s=20.0, num_requests=4, prompt_tokens=500, output_tokens=1000,
                       num_preemptions=2, steps=steps)
    row = bench.sweep_row(32, result, attention_s=5.0, write_kv_s=0.5, attention_calls=3000,
                          cpu_s=40.0)
    assert row["block_size"] == 32
    assert row["attention_share_pct"] == 25.0
    assert row["write_kv_share_pct"] == 2.5
    assert row["attention_calls"] == 3000
    assert row["waste_pct"] == 6.67  # (10 + 10) / 300
    assert row["max_running"] == 4 and row["num_preemptions"] == 2
    assert row["output_tokens_per_s"] == 50.0
    assert row["output_tokens_per_cpu_s"] == 25.0  # 1000 tokens over 40 CPU seconds


def test_call_timer_counts_a_dispatcher_reentry_once():
    timer = CallTimer()
    calls = []

    def inner(depth):
        calls.append(depth)
        return timed(depth - 1) if depth else "done"

    timed = timer.wrap(inner)
    assert timed(2) == "done"
    assert calls == [2, 1, 0]
    assert timer.calls == 1 and timer.seconds >= 0.0


def test_timed_functions_reach_names_imported_elsewhere_and_restore_them(monkeypatch):
    def kernel(x):
        return x + 1

    defining, user = types.ModuleType("fake_kernels"), types.ModuleType("fake_model")
    defining.kernel = kernel
    user.attend = kernel  # `from fake_kernels import kernel as attend`
    monkeypatch.setitem(sys.modules, "fake_kernels", defining)
    monkeypatch.setitem(sys.modules, "fake_model", user)
    with timed_functions(kernel) as (timer,):
        assert user.attend is not kernel and defining.kernel is not kernel
        assert [user.attend(i) for i in range(3)] == [1, 2, 3]
        defining.kernel(0)
    assert timer.calls == 4
    assert user.attend is kernel and defining.kernel is kernel


def test_timed_functions_find_the_model_attention_call():
    import pagedllm.model.llama as llama

    with timed_functions(paged_attention) as (timer,):
        assert llama.paged_attention is not paged_attention
    assert llama.paged_attention is paged_attention and timer.calls == 0
