"""`pagedllm bench long-context` on small contexts: its report's shape and the figures it derives
(never its timings)."""

from __future__ import annotations

import json
import sys

from pagedllm.bench import long_context as bench
from pagedllm.cli import main as cli_main
from pagedllm.core.kv.manager import peak_blocks


def test_upkeep_runs_decode_steps_and_measures_the_block_table_state():
    row = bench.measure_upkeep(batch=3, context_len=100, block_size=8, steps=5, sliding_window=None,
                               prefix_caching=True)
    assert (row["batch"], row["context_len"], row["block_size"], row["steps"]) == (3, 100, 8, 5)
    assert row["num_preemptions"] == 0
    # After the prefill and the warm-up step, 5 decodes: 107 tokens, 14 blocks of 8.
    assert row["bytes"]["held_blocks"] == 14
    assert row["bytes"]["runner_row"] >= 14 * 4 and row["bytes"]["prefix_hashes"] > 0
    windowed = bench.measure_upkeep(batch=3, context_len=100, block_size=8, steps=5,
                                    sliding_window=16, prefix_caching=False)
    assert windowed["bytes"]["held_blocks"] <= peak_blocks(107, 8, 16, 1) == 3
    assert windowed["bytes"]["prefix_hashes"] == sys.getsizeof([])  # nothing hashed


def test_ratios_are_to_the_shortest_context_of_the_same_block_size_and_window():
    rows = [{"context_len": c, "block_size": b, "sliding_window": w, "step_us": us}
            for c, b, w, us in [(1024, 16, None, 10.0), (8192, 16, None, 15.0), (8192, 16, 64, 8.0),
                                (1024, 16, 64, 4.0), (1024, 32, None, 5.0)]]
    bench._add_ratios(rows)
    assert [r["vs_shortest"] for r in rows] == [1.0, 1.5, 2.0, 1.0, 1.0]


def test_the_command_prints_the_tables_and_writes_json_and_a_plot(tmp_path, capsys):
    out, plot = tmp_path / "lc.json", tmp_path / "lc.png"
    assert cli_main(["bench", "long-context", "--contexts", "64,256", "--block-sizes", "16,32",
                     "--batch", "2", "--steps", "3", "--window", "32", "--min-time", "0",
                     "--max-reps", "1", "--dtype", "float32", "--output-json", str(out),
                     "--plot", str(plot)]) == 0
    printed = capsys.readouterr().out
    assert "Per-step upkeep" in printed and "Block-table state per request" in printed
    assert "Attention: one decode" in printed
    report = json.loads(out.read_text())
    assert len(report["upkeep"]) == 2 * 2 * 2  # windows x block sizes x contexts
    assert {(a["context_len"], a["block_size"]) for a in report["attention"]} == {
        (64, 16), (64, 32), (256, 16), (256, 32)}
    assert all(a["window_ms"] > 0 for a in report["attention"])
    assert plot.stat().st_size > 0
