"""`pagedllm bench serve --loads` against a live server, and `bench throughput --temperature`."""

from __future__ import annotations

import json

import pytest

from pagedllm.bench.serve import Load, parse_loads
from pagedllm.cli import main
from tests.server.conftest import RunningServer, tiny_config


def test_loads_parse_as_serve_compare_runs_them():
    assert parse_loads("rate=2,concurrency=8,rate=inf") == [
        Load(2.0), Load(float("inf"), 8), Load(float("inf"))]
    assert [load.label for load in parse_loads("rate=2, concurrency=8")] == ["rate 2", "concurrency 8"]
    for bad in ["rate=0", "rate=fast", "concurrency=0", "speed=3", ""]:
        with pytest.raises(ValueError, match="loads"):
            parse_loads(bad)


def test_a_sweep_reports_each_load_and_plots_them(tiny_model_dir, tmp_path, capsys):
    out, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    with RunningServer(tiny_config(tiny_model_dir, num_kv_blocks=256)) as server:
        code = main(["bench", "serve", "--base-url", server.base_url, "--tokenizer", str(tiny_model_dir),
                     "--num-prompts", "6", "--input-len", "4-16", "--output-len", "4-8",
                     "--loads", "rate=50,concurrency=2", "--temperature", "1",
                     "--output-json", str(out), "--plot", str(plot)])
    assert code == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["load"] for r in runs] == ["rate 50", "concurrency 2"]
    for r in runs:
        assert r["completed"] == 6 and r["failed"] == 0 and r["temperature"] == 1
        assert r["output_token_throughput"] > 0
        assert r["ttft_ms"]["p50"] > 0 and r["tpot_ms"]["p99"] >= r["tpot_ms"]["p50"] > 0
    assert plot.stat().st_size > 0
    printed = capsys.readouterr().out
    assert "TTFT p50" in printed and "ITL p99" in printed and "concurrency 2" in printed


def test_throughput_at_temperature_one(tiny_model_dir, tmp_path):
    out = tmp_path / "throughput.json"
    code = main(["bench", "throughput", "--model", str(tiny_model_dir), "--dtype", "float32",
                 "--num-prompts", "4", "--input-len", "4-16", "--output-len", "4-8",
                 "--temperature", "1", "--output-json", str(out)])
    assert code == 0
    payload = json.loads(out.read_text())
    assert payload["workload"]["temperature"] == 1
    assert payload["pagedllm"]["output_tokens_per_s"] > 0
