"""The constrained bench on the tiny model: both ways generate exactly the same tokens, the mask
is timed only where it runs, and the command writes a row per run and per step size."""

import json

import pytest
import torch

from pagedllm.bench import constrained as bench
from pagedllm.bench.workload import random_workload
from pagedllm.cli import main
from pagedllm.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    torch.set_num_threads(1)
    # No decode bursts, as the bench's own engine (constrained steps take none).
    return LLMEngine(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, decode_burst=1)


def test_free_and_constrained_runs_do_the_same_work(engine):
    workload = random_workload(engine.tokenizer, 3, "4-8", "6-10", seed=1)
    (free,), (constrained,) = bench.alternate(engine, workload, 1, "t")
    assert free.output_tokens == constrained.output_tokens == sum(r.max_tokens for r in workload)
    assert free.mask_s == 0 and constrained.mask_s > 0
    assert free.num_steps == constrained.num_steps >= max(r.max_tokens for r in workload)
    assert engine.engine_core.structured.mask_logits.__name__ == "mask_logits"  # unwrapped again


def test_the_command_writes_every_row(tiny_model_dir, tmp_path):
    out = tmp_path / "constrained.json"
    assert main(["bench", "constrained", "--model", str(tiny_model_dir), "--dtype", "float32",
                 "--num-prompts", "2", "--input-len", "4-8", "--output-len", "6", "--repeats", "2",
                 "--step-sizes", "1,2", "--threads", "1", "--output-json", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert len(payload["throughput"]["ratios"]) == 2
    assert [s["requests"] for s in payload["steps"]] == [1, 2]
    assert all(len(s["constrained"]) == 2 for s in payload["steps"])
