"""Compressed KV caches (int8, fp8): the formats' error bounds, the kernel's writes bit for bit
against the torch path's, attention on compressed pages against the torch oracle (random block
tables, mixed prefill/decode batches, every head size), copy-on-write, and the byte accounting."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import EngineConfig
from pagedllm.kernels.attention import (
    QuantizedKV,
    allocate_kv_cache,
    copy_blocks,
    cpu_attention,
    kv_cache_bytes_per_block,
    torch_ref,
    write_kv,
)
from pagedllm.kernels.attention.kv_quant import FORMATS, dequantize, kv_format, quantize
from tests.kernels.test_cpu_kernel import MIXED, TOLERANCE, make_case

# Runs over every tier this CPU runs whose attention is compiled (none: the tests do not run).
needs_kernel = pytest.mark.usefixtures("attention_tier")
COMPRESSED = list(FORMATS)


def random_heads(seed: int, shape=(37, 3, 64)) -> torch.Tensor:
    """K/V-like rows: each head at its own magnitude, from tiny to larger than fp8_e4m3 holds."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = 10 ** torch.empty(*shape[:-1], 1).uniform_(-6, 3, generator=gen)
    return torch.randn(*shape, generator=gen) * magnitude


def rounding_bound(name: str, y: torch.Tensor) -> torch.Tensor:
    """How far rounding y (a value divided by its scale, within +-max_code) to the format may
    move it: half a step; for fp8, half a unit in the last place among normals, half the
    subnormal step below them."""
    if name == "int8":
        return torch.full_like(y, 0.5)
    mantissa_bits, min_normal, subnormal_step = {"fp8_e4m3": (3, 2.0**-6, 2.0**-9),
                                                 "fp8_e5m2": (2, 2.0**-14, 2.0**-16)}[name]
    return torch.where(y.abs() >= min_normal, y.abs() * 2.0 ** -(mantissa_bits + 1), subnormal_step / 2)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), head_dim=st.sampled_from([16, 64, 256]),
       name=st.sampled_from(COMPRESSED))
def test_quantize_error_is_the_formats_rounding(seed, head_dim, name):
    fmt = FORMATS[name]
    x = random_heads(seed, (5, 2, head_dim))
    codes, scale = quantize(x, fmt)
    assert scale.dtype == torch.float16 and codes.dtype == fmt.storage
    values = dequantize(codes, scale, torch.float32)
    assert torch.isfinite(values).all()
    s = scale.float().unsqueeze(-1)
    # The scale is rounded up, never to 0: no element lies past max_code.
    assert (s >= x.abs().amax(-1, keepdim=True) / fmt.max_code).all() and (s > 0).all()
    bound = s * rounding_bound(name, x / s)
    assert ((values - x).abs() <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("name", COMPRESSED)
def test_zero_heads_quantize_to_zero(name):
    codes, scale = quantize(torch.zeros(3, 2, 16), FORMATS[name])
    assert not codes.float().any() and not scale.any()


@needs_kernel
@pytest.mark.parametrize("name", COMPRESSED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_writes_the_same_codes_and_scales_as_torch(name, dtype):
    """From strided K/V views of fused q/k/v rows, as the model passes them."""
    num_kv_heads, head_dim, tokens = 3, 64, 29
    qkv = random_heads(2, (tokens, 9 + 2 * num_kv_heads, head_dim)).flatten(1).to(dtype)
    _, key, value = qkv.split([9 * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    key, value = key.view(tokens, num_kv_heads, head_dim), value.view(tokens, num_kv_heads, head_dim)
    slots = torch.randperm(10 * 4)[:tokens]
    ours, reference = (allocate_kv_cache(1, 10, 4, num_kv_heads, head_dim, dtype, kv_cache_dtype=name)[0]
                       for _ in range(2))
    assert cpu_attention.write_kv_supports(key, ours[0])
    cpu_attention.write_kv(key, value, *ours, slots)
    torch_ref.write_kv(key, value, *reference, slots)
    for got, expected in zip(ours, reference):
        assert torch.equal(got.data.view(torch.uint8), expected.data.view(torch.uint8))
        assert torch.equal(got.scale, expected.scale)


def compressed_case(requests, name, **shape):
    """make_case's batch with its cache compressed (garbage in unused blocks included)."""
    query, key_cache, value_cache, meta = make_case(requests, **shape)
    return query, QuantizedKV.from_values(key_cache, name), QuantizedKV.from_values(value_cache, name), meta


def compare(requests, name, *, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64,
            dtype=torch.float32, sliding_window=None, seed=0):
    query, key_cache, value_cache, meta = compressed_case(
        requests, name, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=dtype, seed=seed)
    scale = head_dim**-0.5
    assert cpu_attention.supports(query, key_cache)
    expected = torch_ref.paged_attention(query, key_cache, value_cache, meta, scale, sliding_window)
    got = cpu_attention.paged_attention(query, key_cache, value_cache, meta, scale, sliding_window)
    assert got.dtype == dtype and got.shape == query.shape
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


@needs_kernel
@pytest.mark.parametrize("name", COMPRESSED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_kernel_matches_torch_on_a_mixed_batch(name, dtype, block_size):
    compare(MIXED, name, block_size=block_size, dtype=dtype, seed=block_size)


@needs_kernel
@pytest.mark.parametrize("name", COMPRESSED)
@pytest.mark.parametrize("heads", [(4, 4, 16), (6, 1, 32), (9, 3, 64), (8, 2, 128), (4, 2, 256)])
def test_kernel_matches_torch_for_every_head_size(name, heads):
    num_heads, num_kv_heads, head_dim = heads
    for dtype in (torch.float32, torch.bfloat16):
        compare([(0, 19), (40, 1), (3, 33), (0, 1)], name, num_heads=num_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, block_size=8)


@needs_kernel
@pytest.mark.parametrize("name", COMPRESSED)
def test_kernel_matches_torch_with_a_sliding_window(name):
    compare([(0, 50), (70, 1), (30, 21), (9, 1)], name, sliding_window=5, block_size=4)


@needs_kernel
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), name=st.sampled_from(COMPRESSED),
       block_size=st.sampled_from([2, 8, 32]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       requests=st.lists(st.tuples(st.integers(0, 200), st.sampled_from([1, 1, 2, 17, 40])),
                         min_size=1, max_size=8))
def test_kernel_matches_torch_on_random_batches(seed, name, block_size, dtype, requests):
    compare(requests, name, block_size=block_size, dtype=dtype, seed=seed % 1000)


@pytest.mark.parametrize("name", COMPRESSED)
def test_attention_reads_back_what_write_kv_stored(name):
    """Through the public functions (kernel or torch, whichever runs): attention over a compressed
    cache equals the torch path's attention over a plain cache holding the dequantized values."""
    query, key_cache, value_cache, meta = make_case(
        [(0, 12), (30, 1)], block_size=4, num_heads=4, num_kv_heads=2, head_dim=32,
        dtype=torch.float32, seed=4)
    compressed = allocate_kv_cache(1, key_cache.shape[0], 4, 2, 32, torch.float32, kv_cache_dtype=name)[0]
    slots = torch.arange(key_cache.shape[0] * 4)
    write_kv(key_cache.flatten(0, 1), value_cache.flatten(0, 1), *compressed, slots)
    plain = [dequantize(c.data, c.scale, torch.float32) for c in compressed]
    from pagedllm.kernels.attention import paged_attention

    torch.testing.assert_close(paged_attention(query, *compressed, meta, 0.3),
                               torch_ref.paged_attention(query, *plain, meta, 0.3),
                               **TOLERANCE[torch.float32])


@pytest.mark.parametrize("name", COMPRESSED)
def test_copy_blocks_copies_codes_and_scales(name):
    caches = allocate_kv_cache(2, 6, 4, 2, 16, torch.float32, kv_cache_dtype=name)
    values = random_heads(5, (6 * 4, 2, 16))
    for key_cache, value_cache in caches:
        write_kv(values, -values, key_cache, value_cache, torch.arange(24))
    copy_blocks(caches, [1, 4], [3, 0])
    for side in (side for layer in caches for side in layer):
        for tensor in (side.data.view(torch.uint8), side.scale):
            assert torch.equal(tensor[3], tensor[1]) and torch.equal(tensor[0], tensor[4])


@pytest.mark.parametrize("name", ["auto", *COMPRESSED])
def test_bytes_per_block_is_what_allocate_takes(name):
    caches = allocate_kv_cache(3, 5, 16, 2, 64, torch.bfloat16, kv_cache_dtype=name)
    tensors = [t for layer in caches for side in layer
               for t in ([side.data, side.scale] if isinstance(side, QuantizedKV) else [side])]
    total = sum(t.numel() * t.element_size() for t in tensors)
    assert total == 5 * kv_cache_bytes_per_block(3, 16, 2, 64, torch.bfloat16, name)


def test_int8_holds_at_least_1_9x_the_tokens_of_bf16_and_3_8x_of_fp32():
    for head_dim in (64, 128):
        int8 = kv_cache_bytes_per_block(30, 16, 3, head_dim, torch.bfloat16, "int8")
        assert kv_cache_bytes_per_block(30, 16, 3, head_dim, torch.bfloat16) / int8 >= 1.9
        assert kv_cache_bytes_per_block(30, 16, 3, head_dim, torch.float32) / int8 >= 3.8


def test_fp8_is_vllms_alias_for_e4m3():
    assert kv_format("fp8") == kv_format("fp8_e4m3") == FORMATS["fp8_e4m3"]
    assert kv_format("auto") is None


@pytest.mark.parametrize("bad", ["int4", "fp16", "FP8", "", None])
def test_a_bad_kv_cache_dtype_is_refused_with_the_valid_ones(bad):
    with pytest.raises(ValueError) as info:
        EngineConfig(kv_cache_dtype=bad)
    for name in ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"):
        assert name in str(info.value)
