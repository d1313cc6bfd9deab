"""The Triton paged-attention kernel against the portable torch path: random block tables, batches
mixing fresh prefills, chunks after cached context and decodes, GQA/MQA, sliding windows, logit
soft-capping, compressed pages (int8, fp8_e4m3, fp8_e5m2), fp32, bf16 and fp16, both launch
shapes. On CUDA where there is one (`make gpu-check`), natively;
elsewhere on Triton's CPU interpreter, which is slow: the shapes here are kept small."""

from __future__ import annotations

import os
import random

import pytest
import torch

ON_GPU = torch.cuda.is_available()
# Triton reads TRITON_INTERPRET when a kernel is decorated (its own library's kernels on the first
# `import triton`, ours on importing triton_attention) and when one runs (the fixture below keeps
# it set for this module's tests). So it is set before anything imports triton (tests/conftest.py
# sets it first for the whole session).
_SAVED_INTERPRET = os.environ.get("TRITON_INTERPRET")
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed: pip install triton (make test does)")
from pagedllm.kernels.attention import QuantizedKV, torch_ref, triton_attention  # noqa: E402
from tests.conftest import after_nan_block, punch_window_holes  # noqa: E402
from tests.kernels.test_cpu_kernel import make_case as make_host_case  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


def make_case(*args, **kwargs):
    """test_cpu_kernel's case on DEVICE (written there: on a GPU, no CPU kernel is built)."""
    return make_host_case(*args, device=DEVICE, **kwargs)
pytestmark = pytest.mark.skipif(
    not ON_GPU and not triton_attention.interpreting(),
    reason="no CUDA, and triton was imported before TRITON_INTERPRET=1 could be set")



@pytest.fixture(autouse=True, scope="module")
def _interpreter_while_testing():
    if ON_GPU:
        yield
        return
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if _SAVED_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _SAVED_INTERPRET


# The kernel and the torch path round differently (online softmax, exp2, their own matmul orders):
# fp32 to float rounding; the 16-bit types to a few of their steps.
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
             torch.float16: dict(atol=4e-3, rtol=4e-3)}


COMPRESSED = ["int8", "fp8_e4m3", "fp8_e5m2"]


def on_device(query, key_cache, value_cache, meta):
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        setattr(meta, name, getattr(meta, name).to(DEVICE))
    return query.to(DEVICE), _to_device(key_cache), _to_device(value_cache), meta


def _to_device(cache):
    if isinstance(cache, QuantizedKV):
        return QuantizedKV(cache.data.to(DEVICE), cache.scale.to(DEVICE))
    return cache.to(DEVICE)


def _as_float32(cache):
    """The oracle's cache: plain ones widened to float32; compressed ones as they are (the torch
    path dequantizes them and attends in float32)."""
    return cache if isinstance(cache, QuantizedKV) else cache.float()


def compare(requests, *, block_size=16, num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32,
            sliding_window=None, softcap=None, kv_cache_dtype="auto", seed=0, block_m=None,
            tile_size=None):
    query, key_cache, value_cache, meta = make_case(
        requests, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=dtype, seed=seed)
    if kv_cache_dtype != "auto":
        key_cache = QuantizedKV.from_values(key_cache, kv_cache_dtype)
        value_cache = QuantizedKV.from_values(value_cache, kv_cache_dtype)
    query, key_cache, value_cache, meta = on_device(query, key_cache, value_cache, meta)
    scale = head_dim**-0.5
    assert triton_attention.supports(query, key_cache)
    got = triton_attention.paged_attention(query, key_cache, value_cache, meta, scale, sliding_window,
                                           softcap, block_m=block_m, tile_size=tile_size)
    # The oracle in float32 on the same (rounded, or quantized) inputs.
    expected = torch_ref.paged_attention(query.float(), _as_float32(key_cache), _as_float32(value_cache),
                                         meta, scale, sliding_window, softcap)
    assert got.dtype == dtype and got.shape == query.shape and got.device == query.device
    torch.testing.assert_close(got.float(), expected, **TOLERANCE[dtype])


MIXED = [(0, 21), (5, 1), (70, 1), (30, 9), (0, 1), (17, 12)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_m", [16, 64])
def test_mixed_batch_matches_torch(dtype, block_m):
    compare(MIXED, dtype=dtype, block_m=block_m, seed=block_m)


@pytest.mark.parametrize("block_size,tile_size", [(1, 16), (4, 32), (32, 16), (16, 64)])
def test_block_sizes_and_tiles(block_size, tile_size):
    """Tiles spanning many cache blocks, and cache blocks spanning several tiles."""
    compare(MIXED, block_size=block_size, tile_size=tile_size, seed=block_size)


@pytest.mark.parametrize("heads", [(4, 4, 16), (8, 2, 128), (6, 1, 32), (4, 2, 24), (12, 4, 64)])
def test_head_shapes(heads):
    """MHA, GQA, MQA with a group of 6 (rows padded to the block), a head size that is not a
    power of two (24, as the tiny test models have)."""
    num_heads, num_kv_heads, head_dim = heads
    compare([(0, 13), (40, 1), (3, 9)], num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, block_size=8)


@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window(window):
    compare([(0, 30), (70, 1), (30, 11), (9, 1)], sliding_window=window, block_size=4, block_m=16)


@pytest.mark.parametrize("seed", range(3))
def test_random_batches(seed):
    rng = random.Random(seed)
    requests = [(rng.choice([0, rng.randint(0, 90)]), rng.choice([1, 1, rng.randint(1, 24)]))
                for _ in range(rng.randint(1, 7))]
    compare(requests, block_size=rng.choice([2, 8, 16]),
            dtype=rng.choice([torch.float32, torch.bfloat16, torch.float16]),
            sliding_window=rng.choice([None, None, rng.randint(1, 40)]), seed=seed)


@pytest.mark.parametrize("softcap", [0.5, 5.0, 50.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_capped_scores(softcap, dtype):
    """Gemma 2's cap, from one that flattens every score (0.5) to one that barely touches them."""
    compare(MIXED, softcap=softcap, dtype=dtype, seed=int(softcap * 10), block_m=16)


def test_soft_cap_with_a_window_and_large_scores():
    """Scores far past the cap (queries scaled up): tanh saturates, no inf or NaN comes out."""
    query, key_cache, value_cache, meta = on_device(*make_case(
        [(0, 17), (40, 1), (9, 6)], block_size=4, num_heads=4, num_kv_heads=2, head_dim=32,
        dtype=torch.float32, seed=11))
    query = query * 300
    got = triton_attention.paged_attention(query, key_cache, value_cache, meta, 32**-0.5, 7, 20.0)
    expected = torch_ref.paged_attention(query, key_cache, value_cache, meta, 32**-0.5, 7, 20.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("kv_cache_dtype", COMPRESSED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compressed_pages(kv_cache_dtype, dtype):
    """Codes and their per-token scales read in the inner loop, against the torch path's
    attention over the dequantized values (in float32)."""
    compare(MIXED, kv_cache_dtype=kv_cache_dtype, dtype=dtype, seed=len(kv_cache_dtype), block_m=16)


@pytest.mark.parametrize("kv_cache_dtype", COMPRESSED)
def test_compressed_pages_with_window_softcap_and_odd_heads(kv_cache_dtype):
    """Everything at once: a window, a cap, a group of 3 and a head size of 24, tiles spanning
    several blocks."""
    compare([(0, 30), (70, 1), (30, 11), (9, 1)], num_heads=6, num_kv_heads=2, head_dim=24,
            block_size=4, tile_size=32, sliding_window=9, softcap=30.0, kv_cache_dtype=kv_cache_dtype,
            dtype=torch.bfloat16, seed=3)


@pytest.mark.parametrize("kv_cache_dtype", COMPRESSED)
def test_compressed_blocks_before_the_window_are_never_read(kv_cache_dtype):
    """Holes (-1) before each window, the scales laid after a block of NaN scales: reading a hole's
    codes and scale would bring a NaN in."""
    window = 10
    query, key_cache, value_cache, meta = make_case(
        MIXED, block_size=4, num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32, seed=8)
    key_cache, value_cache = (QuantizedKV.from_values(c, kv_cache_dtype) for c in (key_cache, value_cache))
    query, key_cache, value_cache, meta = on_device(query, key_cache, value_cache, meta)
    expected = torch_ref.paged_attention(query, key_cache, value_cache, meta, 0.2, window)
    holed = punch_window_holes(meta, window, 4)
    key_cache, value_cache = (QuantizedKV(c.data, after_nan_block(c.scale)) for c in (key_cache, value_cache))
    got = triton_attention.paged_attention(query, key_cache, value_cache, holed, 0.2, window, tile_size=32)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("seed", range(3))
def test_random_compressed_batches(seed):
    rng = random.Random(100 + seed)
    requests = [(rng.choice([0, rng.randint(0, 90)]), rng.choice([1, 1, rng.randint(1, 24)]))
                for _ in range(rng.randint(1, 6))]
    compare(requests, block_size=rng.choice([2, 8, 16]), kv_cache_dtype=rng.choice(COMPRESSED),
            dtype=rng.choice([torch.float32, torch.bfloat16]),
            sliding_window=rng.choice([None, rng.randint(1, 40)]),
            softcap=rng.choice([None, 30.0]), seed=seed)


def test_compressed_supports_only_code_dtypes():
    query = torch.zeros(2, 4, 32, device=DEVICE)
    codes = torch.zeros(4, 16, 2, 32, dtype=torch.int8, device=DEVICE)
    scales = torch.zeros(4, 16, 2, dtype=torch.float16, device=DEVICE)
    assert triton_attention.supports(query, QuantizedKV(codes, scales))
    assert not triton_attention.supports(query, QuantizedKV(codes.to(torch.int16), scales))
    assert not triton_attention.supports(query, codes.float().half())  # a plain cache of another dtype


def test_queries_as_strided_views_of_fused_qkv():
    """The model passes q as a view of the fused q/k/v rows (token stride wider than the heads)."""
    query, key_cache, value_cache, meta = on_device(*make_case(
        [(0, 9), (12, 1)], block_size=4, num_heads=4, num_kv_heads=2, head_dim=16,
        dtype=torch.float32, seed=5))
    qkv = torch.randn(query.shape[0], 8 * 16, device=DEVICE)
    view = qkv[:, :64].view(-1, 4, 16)
    view.copy_(query)
    assert not view.is_contiguous()
    got = triton_attention.paged_attention(view, key_cache, value_cache, meta, 0.25)
    torch.testing.assert_close(got, torch_ref.paged_attention(query, key_cache, value_cache, meta, 0.25),
                               **TOLERANCE[torch.float32])


def test_fake_tensors_check_placement():
    """Under FakeTensorMode (how the engine's step is checked on machines without a GPU) the op
    gives a fake CUDA result, and refuses metadata left on the CPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        query = torch.empty(5, 4, 16, device="cuda")
        cache = torch.empty(8, 4, 2, 16, device="cuda")
        table = torch.zeros(2, 3, dtype=torch.int32, device="cuda")
        seq_lens = torch.zeros(2, dtype=torch.int32, device="cuda")
        starts = torch.zeros(3, dtype=torch.int32, device="cuda")
        out = torch.ops.pagedllm_triton.paged_attention(query, cache, cache, None, None, table, seq_lens,
                                                        starts, 0.25, 0, 0.0, 16, 16)
        assert out.device.type == "cuda" and out.shape == query.shape
        with pytest.raises(RuntimeError, match="block_tables"):
            torch.ops.pagedllm_triton.paged_attention(query, cache, cache, None, None, table.cpu(),
                                                      seq_lens, starts, 0.25, 0, 0.0, 16, 16)
        scales = torch.empty(8, 4, 2, dtype=torch.float16)  # on the host
        with pytest.raises(RuntimeError, match="key_scale"):
            torch.ops.pagedllm_triton.paged_attention(query, cache, cache, scales, scales, table,
                                                      seq_lens, starts, 0.25, 0, 0.0, 16, 16)


@pytest.mark.parametrize("shape", ["mistral_linear_rope_window", "llama_mha_tied_bias"])
def test_a_tiny_model_through_the_kernel_matches_the_torch_path(shape, tmp_path, monkeypatch):
    """A whole model (q as views of the fused q/k/v rows, a sliding window, a head size of 24):
    a mixed prefill step, then batched decodes, with every attention call on the kernel."""
    pytest.importorskip("transformers")
    from pagedllm.model import llama
    from pagedllm.model.loader import load_model
    from tests.model.paged import PagedSequences
    from tests.model.tiny import make_hf_model, save_checkpoint

    model = load_model(save_checkpoint(make_hf_model(shape), tmp_path), dtype="float32",
                       device=DEVICE).model
    prompts = {0: [5, 9, 20, 33, 41, 7, 7, 100, 3, 18, 2], 1: [77, 1, 250], 2: [12] * 13}

    def run(attention_fn) -> list[torch.Tensor]:
        monkeypatch.setattr(llama, "paged_attention", attention_fn)
        paged = PagedSequences(model, num_blocks=24, block_size=4)
        logits = [paged.step(prompts)]
        for step in range(2):
            logits.append(paged.step({seq: [40 + step + seq] for seq in prompts}))
        return [t for step in logits for t in step.values()]

    for got, expected in zip(run(triton_attention.paged_attention), run(torch_ref.paged_attention)):
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("block_size,tile_size", [(4, 32), (16, 16)])
def test_blocks_before_the_window_are_never_read(block_size, tile_size):
    """Holes (-1) where the KV manager gave back blocks out of the window: a key tile that starts
    before the window (tiles are aligned to their size, wider than a block here) must not load
    them."""
    window = 10
    query, key_cache, value_cache, meta = on_device(*make_case(
        MIXED, block_size=block_size, num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32,
        seed=6))
    expected = torch_ref.paged_attention(query, key_cache, value_cache, meta, 0.2, window)
    holed = punch_window_holes(meta, window, block_size)
    key_cache, value_cache = after_nan_block(key_cache), after_nan_block(value_cache)
    got = triton_attention.paged_attention(query, key_cache, value_cache, holed, 0.2, window,
                                           tile_size=tile_size)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])
