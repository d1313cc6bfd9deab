"""The memory bench's accounting on small exact cases (the headline numbers are the bench's job)."""

import argparse

from pagedllm.bench.common import RunResult, StepRecord
from pagedllm.bench.memory import layout_figures, simulate_workload, simulated_scheduler
from pagedllm.bench.workload import BenchRequest, parse_range, random_workload


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


def test_time_weighted_waste_weights_each_state_by_how_long_it_lasted():
    steps = [StepRecord(0.0, allocated_slots=100, used_slots=50, running=1, waiting=0),
             StepRecord(3.0, allocated_slots=100, used_slots=100, running=1, waiting=0),
             StepRecord(4.0, allocated_slots=0, used_slots=0, running=0, waiting=0)]
    figures = layout_figures(RunResult(4.0, 1, 10, 10, 0, steps))
    assert figures["waste_pct"] == 25.0  # per step: 50 / 200
    assert figures["waste_pct_time_weighted"] == 37.5  # 3 s half empty, 1 s full: 150 / 400
    assert "waste_pct_time_weighted" not in layout_figures(RunResult(0.0, 1, 10, 10, 0, steps),
                                                           timed=False)


def _sim_args(**overrides):
    values = {"max_num_seqs": 256, "max_num_batched_tokens": 2048, "block_size": 4}
    return argparse.Namespace(**{**values, **overrides})


def test_simulation_of_a_tiny_workload_exactly():
    # Budget: 2 reservations of max_model_len 16 = 8 blocks of 4 = 32 slots.
    requests = [BenchRequest([1, 2, 3], max_tokens=2) for _ in range(3)]
    paged = simulate_workload(simulated_scheduler(_sim_args(), "paged", 16, 8), requests)
    # step 1 prefills all three (a block each, 3 of 4 slots filled); step 2 fills the 4th, all finish
    assert [(s.allocated_slots, s.used_slots, s.running, s.waiting) for s in paged.steps] == [
        (12, 9, 3, 0), (0, 0, 0, 0)]
    assert paged.output_tokens == 6 and paged.num_preemptions == 0
    figures = layout_figures(paged, timed=False)
    assert figures["waste_pct"] == 25.0 and figures["max_running"] == 3

    contiguous = simulate_workload(simulated_scheduler(_sim_args(), "contiguous", 16, 8), requests)
    steps = [(s.allocated_slots, s.used_slots, s.running, s.waiting) for s in contiguous.steps]
    assert steps[0] == (32, 6, 2, 1)  # two reservations of 16 fill the budget; one waits
    assert layout_figures(contiguous, timed=False)["max_running"] == 2
    assert contiguous.output_tokens == 6


def test_simulation_matches_a_real_engine_run_step_by_step(default_model, monkeypatch):
    """With ignore_eos the model's tokens decide nothing, so the scheduler alone reproduces the
    engine's memory timeline: under preemption (paged) and reservation (contiguous)."""
    import pagedllm.engine.core_loader as loader_module
    from pagedllm.bench.common import run_workload
    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine

    monkeypatch.setattr(loader_module, "load_engine_model", lambda *args, **kwargs: (default_model, None))
    requests = random_workload(default_model.tokenizer, 8, "10-50", "3-12", seed=4)
    for layout in ("paged", "contiguous"):
        engine = LLMEngine(EngineConfig(dtype="float32", block_size=4, max_model_len=64,
                                        num_kv_blocks=32, kv_layout=layout,
                                        enable_prefix_caching=False,
                                        decode_burst=1))  # the simulation steps a token at a time
        real = run_workload(engine, requests, record_steps=True)
        sim = simulate_workload(simulated_scheduler(_sim_args(), layout, 64, 32), requests)

        def timeline(run):
            return [(s.allocated_slots, s.used_slots, s.running, s.waiting) for s in run.steps]

        assert timeline(sim) == timeline(real)
        assert (sim.num_preemptions, sim.output_tokens) == (real.num_preemptions, real.output_tokens)
        if layout == "paged":
            assert real.num_preemptions == 2  # the 32 blocks run out: preempted and recomputed
        else:
            assert real.num_preemptions == 0 and max(s.running for s in real.steps) == 2
