"""The compiled CPU kernel against the portable torch path: random block tables, batches mixing
fresh prefills, chunks after cached context and decodes, GQA, sliding windows, fp32 and bf16.
And the fallback: where the kernel cannot be built, the torch path runs, with one warning."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from pagedllm.kernels import attention, compiled, tiers
from pagedllm.kernels.attention import allocate_kv_cache, cpu_attention, torch_ref, write_kv
from pagedllm.utils import cdiv
from tests.conftest import after_nan_block, build_attn_metadata, punch_window_holes

# Runs over every tier this CPU runs whose attention is compiled (none: the tests do not run).
needs_kernel = pytest.mark.usefixtures("attention_tier")

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_case(requests, *, block_size, num_heads, num_kv_heads, head_dim, dtype, seed, device="cpu"):
    """A filled paged cache and the metadata of one step. requests: [(num_computed, num_new)].
    device: where it all goes (the values are drawn on the host, the same for every device; the
    cache is written there, so a GPU's case never builds the CPU kernels)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = sum(cdiv(c + n, block_size) for c, n in requests)
    num_blocks = blocks_needed + 3
    physical = list(range(num_blocks))
    rng.shuffle(physical)  # block tables in random physical order
    key_cache, value_cache = allocate_kv_cache(1, num_blocks, block_size, num_kv_heads, head_dim, dtype)[0]
    # Garbage in the unused blocks, so reading past a request's own blocks would show.
    key_cache.normal_(generator=gen)
    value_cache.normal_(generator=gen)
    key_cache, value_cache = key_cache.to(device), value_cache.to(device)
    batch = [(c, n, [physical.pop() for _ in range(cdiv(c + n, block_size))]) for c, n in requests]
    full, _ = build_attn_metadata([(0, c + n, b) for c, n, b in batch], block_size)
    total = full.slot_mapping.numel()
    write_kv(torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype).to(device),
             torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype).to(device),
             key_cache, value_cache, full.slot_mapping.to(device))
    meta, _ = build_attn_metadata(batch, block_size)
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        setattr(meta, name, getattr(meta, name).to(device))
    num_tokens = sum(n for _, n in requests)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype).to(device)
    return query, key_cache, value_cache, meta


def compare(requests, *, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64,
            dtype=torch.float32, sliding_window=None, softcap=None, seed=0):
    query, key_cache, value_cache, meta = make_case(
        requests, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=dtype, seed=seed)
    scale = head_dim**-0.5
    expected = torch_ref.paged_attention(query, key_cache, value_cache, meta, scale, sliding_window,
                                         softcap)
    # bf16 prefill runs on AMX tiles where the CPU has them; the AVX-512 path must hold too.
    for use_amx in (True, False) if dtype == torch.bfloat16 else (False,):
        got = cpu_attention.paged_attention(query, key_cache, value_cache, meta, scale, sliding_window,
                                         softcap, use_amx=use_amx)
        assert got.dtype == dtype and got.shape == query.shape
        torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


MIXED = [(0, 37), (5, 1), (100, 1), (64, 20), (0, 1), (31, 1), (17, 40), (250, 1)]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
def test_mixed_batch_matches_torch(dtype, block_size):
    compare(MIXED, block_size=block_size, dtype=dtype, seed=block_size)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4, 16), (8, 2, 128), (9, 3, 64), (6, 1, 32)])
def test_head_shapes(dtype, heads):
    num_heads, num_kv_heads, head_dim = heads
    compare([(0, 19), (40, 1), (3, 33), (0, 1)], num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, dtype=dtype, block_size=8)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 16, 100])
def test_sliding_window(dtype, window):
    compare([(0, 50), (70, 1), (30, 21), (9, 1)], dtype=dtype, sliding_window=window, block_size=4)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("softcap", [0.5, 3.0, 50.0])
def test_soft_capped_scores(dtype, window, softcap):
    # Scores here are about N(0, 1): a cap of 0.5 bends nearly all of them, 50 almost none.
    compare(MIXED, dtype=dtype, sliding_window=window, softcap=softcap, block_size=8, seed=7)


@needs_kernel
@pytest.mark.parametrize("seed", range(6))
def test_random_batches(seed):
    rng = random.Random(seed)
    requests = [(rng.choice([0, rng.randint(0, 300)]), rng.choice([1, 1, rng.randint(1, 70)]))
                for _ in range(rng.randint(1, 12))]
    compare(requests, block_size=rng.choice([2, 8, 16]), dtype=rng.choice([torch.float32, torch.bfloat16]),
            seed=seed)


@needs_kernel
def test_long_prefill_and_many_decodes():
    compare([(0, 300)] + [(rng_len, 1) for rng_len in range(0, 640, 10)], dtype=torch.bfloat16)


# Decodes in bf16 with blocks of 16 or more take the tile unit where the CPU has AMX (scores of
# 16 keys x up to 16 query heads per tile, softmax a chunk at a time): tile edges, several column
# tiles (32 heads), one kv head for all, head dims 32 and 128, windows and soft caps.
DECODES = [(c, 1) for c in (0, 1, 14, 15, 16, 17, 63, 64, 65, 255, 300, 701)]


@needs_kernel
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128), (8, 1, 64), (4, 4, 32)])
def test_decodes_on_the_tile_unit(block_size, heads):
    num_heads, num_kv_heads, head_dim = heads
    compare(DECODES, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, dtype=torch.bfloat16, seed=block_size + num_heads)


@needs_kernel
@pytest.mark.parametrize("window, softcap", [(40, None), (None, 3.0), (100, 30.0)])
def test_decodes_on_the_tile_unit_with_window_and_cap(window, softcap):
    compare(DECODES, block_size=16, dtype=torch.bfloat16, sliding_window=window, softcap=softcap, seed=3)


@needs_kernel
def test_dispatch_uses_kernel():
    query, key_cache, value_cache, meta = make_case(
        [(3, 5)], block_size=4, num_heads=2, num_kv_heads=1, head_dim=16, dtype=torch.float32, seed=1)
    assert cpu_attention.supports(query, key_cache)
    torch.testing.assert_close(attention.paged_attention(query, key_cache, value_cache, meta, 0.25),
                               cpu_attention.paged_attention(query, key_cache, value_cache, meta, 0.25))


def test_unsupported_calls_take_the_torch_path():
    query, key_cache, value_cache, meta = make_case(
        [(3, 5), (2, 1)], block_size=4, num_heads=2, num_kv_heads=1, head_dim=8, dtype=torch.float32,
        seed=2)  # head_dim 8: not a multiple of 16
    assert not cpu_attention.supports(query, key_cache)
    torch.testing.assert_close(attention.paged_attention(query, key_cache, value_cache, meta, 0.3),
                               torch_ref.paged_attention(query, key_cache, value_cache, meta, 0.3))


def test_failed_build_falls_back_with_one_warning(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(compiled, "_loaded", {})
    monkeypatch.setattr(tiers, "_choice", [])
    monkeypatch.setattr(compiled, "_why_unavailable", lambda tier: None)
    monkeypatch.setattr(compiled, "_build_name", lambda tier: "pagedllm_test_broken")
    monkeypatch.setattr(compiled, "_TIER_SOURCES", {t: ("does_not_exist.cpp",) for t in tiers.TIERS})
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    query, key_cache, value_cache, meta = make_case(
        [(0, 6), (4, 1)], block_size=4, num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
        seed=3)
    with caplog.at_level(logging.WARNING, logger="pagedllm.kernels.compiled"):
        for _ in range(3):
            out = attention.paged_attention(query, key_cache, value_cache, meta, 0.25)
    torch.testing.assert_close(out, torch_ref.paged_attention(query, key_cache, value_cache, meta, 0.25))
    warnings = [r for r in caplog.records if "portable torch path" in r.getMessage()]
    assert len(warnings) == 1
    assert "did not build" in tiers.current().describe()


def test_env_turns_the_kernel_off(monkeypatch):
    monkeypatch.setattr(tiers, "_choice", [])
    monkeypatch.setenv("PAGEDLLM_ATTENTION", "torch")
    assert not tiers.available()
    assert tiers.current().tier == "portable"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_from_strided_rows_matches_torch(dtype):
    """K/V taken as views of fused q/k/v rows land in the same slots as the torch path puts them."""
    num_kv_heads, head_dim, tokens = 3, 64, 21
    qkv = torch.randn(tokens, (9 + 2 * num_kv_heads) * head_dim).to(dtype)
    _, key, value = qkv.split([9 * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    key, value = key.view(tokens, num_kv_heads, head_dim), value.view(tokens, num_kv_heads, head_dim)
    slots = torch.randperm(8 * 4)[:tokens]
    caches = [allocate_kv_cache(1, 8, 4, num_kv_heads, head_dim, dtype)[0] for _ in range(2)]
    cpu_attention.write_kv(key, value, *caches[0], slots)
    torch_ref.write_kv(key, value, *caches[1], slots)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert cpu_attention.write_kv_supports(key, caches[0][0])


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_blocks_before_the_window_are_never_read(block_size):
    """The KV manager gives back blocks that fell out of the window (holes, -1, in the table):
    the torch path and the kernel read the same as with every block still there."""
    window = 10
    query, key_cache, value_cache, meta = make_case(MIXED, block_size=block_size, num_heads=4,
                                                     num_kv_heads=2, head_dim=32,
                                                     dtype=torch.float32, seed=5)
    holed = punch_window_holes(meta, window, block_size)
    assert (holed.block_tables == -1).any()
    expected = torch_ref.paged_attention(query, key_cache, value_cache, meta, 0.2, window)
    key_cache, value_cache = after_nan_block(key_cache), after_nan_block(value_cache)
    torch.testing.assert_close(
        torch_ref.paged_attention(query, key_cache, value_cache, holed, 0.2, window), expected,
        atol=1e-6, rtol=1e-6)
    if tiers.current().has("attention"):
        torch.testing.assert_close(
            cpu_attention.paged_attention(query, key_cache, value_cache, holed, 0.2, window), expected,
            **TOLERANCE[torch.float32])


# -- touch_blocks: faulting a step's new blocks in before the model writes them ------------------

@needs_kernel
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_touch_blocks_keeps_every_block_as_it_was(kv_cache_dtype):
    # Blocks of 5 rows x 3 x 70 bf16 (2,100 bytes) straddle pages in every way; random contents.
    caches = allocate_kv_cache(2, 40, 5, 3, 70, torch.bfloat16, "cpu", kv_cache_dtype)
    parts = [part for layer in caches for side in layer
             for part in ((side.data, side.scale) if kv_cache_dtype != "auto" else (side,))]
    for part in parts:
        part.view(torch.uint8).copy_(torch.randint(0, 256, part.view(torch.uint8).shape, dtype=torch.uint8))
    before = [part.clone() for part in parts]
    cpu_attention.touch_blocks(caches, torch.tensor([0, 7, 39, 7, 12]))
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(parts, before))


@needs_kernel
def test_touch_blocks_refuses_a_block_outside_the_cache():
    caches = allocate_kv_cache(1, 4, 16, 1, 8, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_attention.touch_blocks(caches, torch.tensor([4]))
    with pytest.raises(RuntimeError, match="int64"):
        cpu_attention.touch_blocks(caches, torch.tensor([1], dtype=torch.int32))
