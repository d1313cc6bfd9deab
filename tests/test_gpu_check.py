"""`make gpu-check` where it can be checked without a GPU: it refuses to run without CUDA, saying
why, and its report reads the JSON that `bench throughput --baseline hf` writes."""

from __future__ import annotations

import torch

from tests import gpu_check


def test_refuses_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_report_row_from_a_throughput_payload():
    payload = {"workload": {"num_requests": 256, "prompt_tokens": 70000, "output_tokens": 36000},
               "pagedllm": {"dtype": "bfloat16", "output_tokens_per_s": 9000.5},
               "hf": {"output_tokens_per_s": 3000.25}, "ratio_output_tokens_per_s": 3.0}
    assert gpu_check._table_row("default", payload) == (
        "| default | bfloat16 | 256 req, 70000 in / 36000 out | 9000.5 | 3000.25 | 3.0x |")
