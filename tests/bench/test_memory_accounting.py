"""The memory bench's accounting on small exact cases (the headline numbers are the bench's job)."""

from pagedllm.bench.common import RunResult, StepRecord
from pagedllm.bench.memory import layout_figures
from pagedllm.bench.workload import parse_range, random_workload


def test_waste_is_empty_slots_over_allocated_slots_across_steps():
    steps = [StepRecord(0.0, allocated_slots=100, used_slots=90, running=2, waiting=3),
             StepRecord(0.1, allocated_slots=300, used_slots=150, running=5, waiting=0),
             StepRecord(0.2, allocated_slots=0, used_slots=0, running=0, waiting=0)]
    figures = layout_figures(RunResult(1.0, 5, 50, 20, 1, steps))
    assert figures["waste_pct"] == 40.0  # (10 + 150) / 400
    assert figures["peak_waste_pct"] == 50.0  # the step with the most allocated: 150 / 300
    assert figures["peak_allocated_slots"] == 300
    assert figures["max_running"] == 5
    assert figures["num_preemptions"] == 1
    assert figures["output_tokens_per_s"] == 20.0


def test_length_ranges():
    assert parse_range("32-512") == (32, 512)
    assert parse_range(64) == (64, 64)


def test_random_workload_is_real_text_and_reproducible(default_model):
    tok = default_model.tokenizer
    a = random_workload(tok, 5, "10-20", "3-4", seed=1)
    b = random_workload(tok, 5, "10-20", "3-4", seed=1)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert all(10 <= len(r.prompt_token_ids) <= 20 and 3 <= r.max_tokens <= 4 for r in a)
    text = tok.decode(a[0].prompt_token_ids)
    assert sum(ch.isalpha() for ch in text) > len(text) / 2  # prose, not random ids
