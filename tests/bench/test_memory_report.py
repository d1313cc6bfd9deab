"""The memory report's frames: bounded however long the run, evenly spread, ending all free."""

from __future__ import annotations

import argparse
from functools import partial

import pytest

from pagedllm.bench.memory import scheduler_figures, simulate_workload, simulated_scheduler
from pagedllm.bench.memory_report import FrameRecorder
from pagedllm.bench.workload import BenchRequest
from pagedllm.core.kv.snapshot import BlockMap


def test_frames_are_thinned_evenly_and_end_with_the_final_state():
    args = argparse.Namespace(max_num_seqs=8, max_num_batched_tokens=64, block_size=4)
    scheduler = simulated_scheduler(args, "paged", 64, 32)
    recorder = FrameRecorder(partial(scheduler_figures, scheduler), scheduler.kv_manager.block_map,
                             max_frames=8)
    requests = [BenchRequest(list(range(1, 10 + i)), max_tokens=20 + 3 * i) for i in range(12)]
    run = simulate_workload(scheduler, requests, recorder.record)
    frames = recorder.finish()
    num_steps = len(run.steps)
    assert num_steps > 40  # long enough to be thinned several times
    times = [frame["t"] for frame in frames]
    assert len(frames) <= 8 + 1 and times == sorted(times) and times[0] == 0
    gaps = {b - a for a, b in zip(times[:-2], times[1:-1])}
    assert len(gaps) == 1  # evenly spread (the final frame aside)
    assert times[-1] == num_steps - 1  # the state after the last step: everything given back
    final = BlockMap.from_dict(frames[-1]["blocks"])
    assert final.counts()["free"] == 32 and frames[-1]["stats"]["num_running"] == 0
    busy = BlockMap.from_dict(frames[1]["blocks"])
    assert busy.counts()["used"] > 0 and busy.owners


def test_at_least_two_frames():
    with pytest.raises(ValueError, match="max_frames"):
        FrameRecorder(dict, None, max_frames=1)
