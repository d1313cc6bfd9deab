"""The block-size sweep's accounting: budgets, time shares, and the call timer that measures them."""

import sys
import types

from pagedllm.attention import paged_attention
from pagedllm.bench import block_size as bench
from pagedllm.bench.common import CallTimer, timed_functions


def test_the_token_budget_is_the_same_for_every_block_size():
    assert [bench.num_blocks_for(16384, bs) for bs in (8, 16, 128)] == [2048, 1024, 128]
    assert bench.num_blocks_for(1000, 64) == 15  # whole blocks only


def test_sweep_row_shares_are_of_the_run_elapsed_time():
    figures = {"waste_pct": 3.5, "peak_waste_pct": 4.0, "max_running": 12, "mean_running": 8.5,
               "num_preemptions": 2, "num_steps": 100, "elapsed_s": 20.0,
               "output_tokens_per_s": 50.0, "total_tokens_per_s": 300.0}
    row = bench.sweep_row(32, figures, attention_s=5.0, write_kv_s=0.5, attention_calls=3000)
    assert row["block_size"] == 32
    assert row["attention_share_pct"] == 25.0
    assert row["write_kv_share_pct"] == 2.5
    assert row["attention_calls"] == 3000
    assert row["waste_pct"] == 3.5 and row["num_preemptions"] == 2


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
