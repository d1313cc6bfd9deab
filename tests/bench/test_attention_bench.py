"""The attention bench's set-up on small exact cases: the paged and contiguous inputs hold the
same numbers, the metadata is the runner's, and the overhead arithmetic (timings are the bench's job)."""

import math

import pytest
import torch

from pagedllm.bench import attention as bench
from pagedllm.kernels.attention import torch_ref
from pagedllm.utils import cdiv
from tests.conftest import build_attn_metadata

SHAPE = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16}


def test_parse_int_list_takes_k_suffixes_and_rejects_junk():
    assert bench.parse_int_list("256, 1k,32K") == [256, 1024, 32768]
    for bad in ("", "0", "ten", "1,-2"):
        with pytest.raises(ValueError, match="positive"):
            bench.parse_int_list(bad)


def test_shuffled_block_tables_use_every_block_once_out_of_order():
    tables = bench.shuffled_block_tables(batch=4, blocks_per_seq=8, seed=3)
    assert tables.shape == (4, 8) and tables.dtype == torch.int32
    assert sorted(tables.flatten().tolist()) == list(range(32))
    assert tables.flatten().tolist() != list(range(32))  # shuffled: paging is real
    assert torch.equal(tables, bench.shuffled_block_tables(4, 8, seed=3))


def test_to_paged_puts_each_tokens_kv_where_the_block_table_says():
    kv = torch.randn(3, 21, 2, 8)  # 21 tokens: the last of 3 blocks of 8 is partial
    tables = bench.shuffled_block_tables(3, 3, seed=0)
    cache = bench.to_paged(kv, tables, block_size=8)
    assert cache.shape == (9, 8, 2, 8)
    for b in range(3):
        for pos in range(21):
            block = tables[b, pos // 8].item()
            assert torch.equal(cache[block, pos % 8], kv[b, pos])


@pytest.mark.parametrize("mode,context_len", [("decode", 37), ("prefill", 19)])
def test_metadata_is_what_the_runner_layout_gives(mode, context_len):
    tables = bench.shuffled_block_tables(2, cdiv(context_len, 8), seed=1)
    query_len = 1 if mode == "decode" else context_len
    meta = bench.paged_metadata(tables, context_len, query_len, block_size=8)
    expected, _ = build_attn_metadata(
        [(context_len - query_len, query_len, tables[b].tolist()) for b in range(2)], block_size=8)
    assert torch.equal(meta.slot_mapping, expected.slot_mapping)
    assert meta.seq_lens_cpu == expected.seq_lens_cpu
    assert meta.query_start_loc_cpu == expected.query_start_loc_cpu
    assert torch.equal(meta.block_tables, expected.block_tables)


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_paged_and_contiguous_compute_the_same_attention(mode):
    case = bench.make_case(mode, batch=3, context_len=45, **SHAPE, block_size=8,
                           dtype=torch.float32, seed=2)
    assert case.query.shape[0] == (3 if mode == "decode" else 3 * 45)
    contiguous = bench.contiguous_as_flat(bench.run_contiguous(case))
    for impl in bench.implementations(case).values():  # the compiled kernel too, where built
        for layout in ("paged", "in_order", "unpaged"):
            torch.testing.assert_close(bench.run_paged(case, impl, layout), contiguous,
                                       atol=1e-4, rtol=1e-4)
    key_in_order, _, meta_in_order = case.paged["in_order"]
    assert meta_in_order.block_tables.flatten().tolist() == list(range(18))  # 3 x 6 blocks of 8
    assert torch.equal(key_in_order.view(3, 48, *key_in_order.shape[2:])[:, :45],
                       case.paged["unpaged"][0])
    key_unpaged, _, meta_unpaged = case.paged["unpaged"]
    assert meta_unpaged.block_tables.flatten().tolist() == [0, 1, 2]  # one block each, in order
    assert key_unpaged.shape == (3, 45, SHAPE["num_kv_heads"], SHAPE["head_dim"])


def test_the_runner_prepare_builds_the_same_slots_and_tables():
    block_size, batch, context_len = 8, 3, 30
    runner, scheduled = bench.make_prepare_runner(batch, context_len, block_size, query_len=1)
    step = runner.prepare_inputs(scheduled)
    positions, meta = step.positions, step.attn_metadata
    assert positions.tolist() == [context_len - 1] * batch
    tables = torch.tensor([s.block_ids for s in scheduled], dtype=torch.int32)
    expected = bench.paged_metadata(tables, context_len, 1, block_size)
    assert torch.equal(meta.slot_mapping, expected.slot_mapping)
    assert torch.equal(meta.block_tables, expected.block_tables)


def test_grid_skips_cases_over_the_token_caps():
    cases = bench.grid(["decode", "prefill"], [256, 4096], [1, 64], max_decode_tokens=64 * 256,
                       max_prefill_tokens=4096)
    assert cases == [("decode", 1, 256), ("decode", 64, 256), ("decode", 1, 4096),
                     ("prefill", 1, 256), ("prefill", 1, 4096)]


def test_overhead_and_its_geometric_mean():
    assert bench.overhead_pct(1.25, 1.0) == 25.0
    assert bench.overhead_pct(0.9, 1.0) == -10.0

    def paged(ms, in_order_ms, unpaged_ms):
        return {"ms": ms, "in_order_ms": in_order_ms, "unpaged_ms": unpaged_ms}

    rows = [{"mode": "decode", "contiguous_ms": 1.0, "active": "x",
             "paged": {"x": paged(2.0, 2.0, 1.6), "y": paged(1.0, 1.0, 1.0)}},
            {"mode": "decode", "contiguous_ms": 4.0, "active": "y",
             "paged": {"x": paged(2.0, 1.0, 1.6), "y": paged(8.0, 8.0, 4.0)}},
            {"mode": "prefill", "contiguous_ms": 1.0, "active": "x", "paged": {"x": paged(1.2, 1.2, 1.2)}}]
    summary = bench.summarize(rows)
    assert summary["x"]["decode"]["vs_contiguous_sdpa"] == {
        "geomean_overhead_pct": 0.0, "min_overhead_pct": -50.0, "max_overhead_pct": 100.0,
        "num_cases": 2}
    assert summary["x"]["decode"]["vs_unpaged"]["geomean_overhead_pct"] == 25.0
    assert summary["x"]["decode"]["vs_in_order"]["geomean_overhead_pct"] == 41.4  # sqrt(1 * 2)
    assert math.isclose(summary["x"]["prefill"]["vs_contiguous_sdpa"]["geomean_overhead_pct"], 20.0)
    assert summary["x"]["prefill"]["vs_unpaged"]["geomean_overhead_pct"] == 0.0
    assert "prefill" not in summary["y"]
    # "active" follows whichever implementation each case ran: 2x then 2x; 1.25x then 2x
    assert summary["active"]["decode"]["vs_contiguous_sdpa"]["geomean_overhead_pct"] == 100.0
    assert summary["active"]["decode"]["vs_unpaged"]["geomean_overhead_pct"] == 58.1


def test_interleaved_timing_runs_every_function_the_same_number_of_rounds():
    calls = {"a": 0, "b": 0}

    def bump(name):
        calls[name] += 1

    medians, rounds = bench.time_interleaved({"a": lambda: bump("a"), "b": lambda: bump("b")},
                                             min_time_s=0.0, max_reps=10)
    assert rounds == 3 and calls == {"a": 4, "b": 4}  # one warm-up call each, then 3 rounds
    assert set(medians) == {"a", "b"} and all(m >= 0 for m in medians.values())


def test_the_active_implementation_is_the_one_the_public_function_ran():
    case = bench.make_case("decode", batch=2, context_len=20, **SHAPE, block_size=8,
                           dtype=torch.float32)
    impls = bench.implementations(case)
    assert list(impls)[-1] == "torch_ref" and impls["torch_ref"] is torch_ref.paged_attention
    assert bench.active_implementation(case, impls) in impls
    # A case only the reference can run (float64) is the reference's.
    case64 = bench.make_case("decode", batch=2, context_len=20, **SHAPE, block_size=8,
                             dtype=torch.float64)
    impls64 = bench.implementations(case64)
    assert list(impls64) == ["torch_ref"]
    assert bench.active_implementation(case64, impls64) == "torch_ref"
