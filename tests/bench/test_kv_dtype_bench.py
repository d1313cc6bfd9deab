"""The kv-dtype bench's pieces that need no model: the dtype list, capacity at one byte budget
(simulated), greedy agreement and the ratios; and the attention bench's compressed cases."""

import argparse
from types import SimpleNamespace

import pytest
import torch

from pagedllm.bench import attention as attention_bench
from pagedllm.bench import kv_dtype as bench
from pagedllm.bench.workload import BenchRequest
from pagedllm.kernels.attention import QuantizedKV, torch_ref

# SmolLM2-135M's KV shape
MODEL = SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3, head_dim=64)


def test_kv_dtypes_are_canonical_unique_auto_first():
    assert bench.kv_dtypes("int8, fp8,auto,fp8_e4m3") == ["auto", "int8", "fp8_e4m3"]
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        bench.kv_dtypes("int8,int4")


def test_capacity_at_one_budget_follows_bytes_per_token():
    args = argparse.Namespace(kv_dtypes="auto,int8,fp8_e5m2", capacity_memory="64MiB",
                              capacity_prompts=400, block_size=16, max_model_len=1024,
                              max_num_seqs=8, max_num_batched_tokens=2048)
    workload = [BenchRequest([1] * 100, 60) for _ in range(400)]
    rows = bench.capacity(args, MODEL, torch.bfloat16, workload)
    assert rows["float32"]["bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert rows["auto"]["bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert rows["int8"]["bytes_per_token"] == rows["fp8_e5m2"]["bytes_per_token"] == 2 * 30 * 3 * 66
    # A request takes 7 blocks of 16 for its prompt of 100 tokens and 10 by its end.
    for row in rows.values():
        assert row["num_blocks"] // 10 <= row["max_running"] <= row["num_blocks"] // 7
    assert rows["int8"]["max_running"] >= 1.9 * rows["auto"]["max_running"]
    assert rows["int8"]["max_running"] >= 3.8 * rows["float32"]["max_running"]


def test_agreement_compares_the_first_tokens_only():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    assert bench.agreement([[1, 2, 3, 0], [5, 6, 0, 8], [0, 9, 9, 9]], reference, 3) == {
        "greedy_agreement": round(1 / 3, 4), "greedy_common_prefix": round((3 + 2 + 0) / 3, 2)}
    assert bench.agreement(reference, reference, 64) == {"greedy_agreement": 1.0,
                                                         "greedy_common_prefix": 4.0}


def test_ratios_against_auto_and_float32():
    rows = {"auto": {"max_running": 10, "decode_attention_ms": {1024: 2.0}, "perplexity": 20.0},
            "int8": {"max_running": 19, "decode_attention_ms": {1024: 1.5}, "perplexity": 20.1}}
    ratios = bench.ratios(rows, {"float32": {"max_running": 5}})
    assert ratios["int8"] == {"max_running_vs_float32": 3.8, "max_running_vs_auto": 1.9,
                              "decode_attention_vs_auto": {1024: 0.75}, "perplexity_change_pct": 0.5}


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_attention_bench_cases_hold_the_compressed_kv(name):
    case = attention_bench.make_case("decode", batch=2, context_len=21, num_heads=4, num_kv_heads=2,
                                     head_dim=16, block_size=8, dtype=torch.float32, seed=1,
                                     kv_cache_dtype=name)
    plain = attention_bench.make_case("decode", batch=2, context_len=21, num_heads=4, num_kv_heads=2,
                                      head_dim=16, block_size=8, dtype=torch.float32, seed=1)
    for layout, (key_cache, value_cache, meta) in case.paged.items():
        assert isinstance(key_cache, QuantizedKV) and isinstance(value_cache, QuantizedKV)
        expected = torch_ref.paged_attention(plain.query, *plain.paged[layout][:2], meta, plain.scale)
        got = torch_ref.paged_attention(case.query, key_cache, value_cache, meta, case.scale)
        torch.testing.assert_close(got, expected, atol=0.1, rtol=0.1)  # the quantization error
