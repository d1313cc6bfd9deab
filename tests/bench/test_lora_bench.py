"""`pagedllm bench lora` end to end on the tiny model: its random adapters are valid PEFT adapters
of the base, every run is reported, and the cycles give every KV block back."""

from __future__ import annotations

import json

from pagedllm.cli import build_parser
from pagedllm.lora.adapter import LoRAAdapter
from pagedllm.model.loader import read_model_config
from tests.model.tiny import make_hf_model, save_checkpoint


def test_the_lora_bench_runs_and_reports(tmp_path, capsys):
    from pagedllm.bench.lora import write_random_adapter

    base = save_checkpoint(make_hf_model("llama_gqa_untied"), tmp_path / "base")
    config = read_model_config(base)
    adapter = LoRAAdapter.load("probe", write_random_adapter(tmp_path / "probe", config, 4, 0), config, 4)
    assert len(adapter.weights) == config.num_hidden_layers * 7 and adapter.scaling == 2.0
    out = tmp_path / "lora.json"
    args = build_parser().parse_args([
        "bench", "lora", "--model", str(base), "--dtype", "float32", "--block-size", "16",
        "--num-kv-blocks", "32", "--num-prompts", "4", "--input-len", "8-16", "--output-len", "4-8",
        "--adapter-counts", "1,2", "--lora-rank", "4", "--cycles", "5", "--output-json", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert list(report["runs"]) == ["base", "1 adapter", "2 adapters", "base again"]
    assert all(run["output_tok_s"] > 0 for run in report["runs"].values())
    assert set(report["rss_mib_by_cycle"]) == {str(i) for i in range(6)}
    assert "x base" in capsys.readouterr().out
