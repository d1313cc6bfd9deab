"""Paged attention against a plain dense causal reference, on scattered block tables."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.kernels.attention import (
    allocate_kv_cache,
    kv_cache_bytes_per_block,
    paged_attention,
    write_kv,
)
from pagedllm.utils import cdiv
from tests.conftest import build_attn_metadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8


def dense_reference(query, key, value, num_computed, scale, sliding_window=None, softcap=None,
                    sinks=None):
    """Naive float64 softmax attention of one request's new tokens over its full K/V; sinks: each
    head's exp(sink) added to its softmax's denominator."""
    q = query.double().transpose(0, 1)  # [Hq, q_len, D]
    group = NUM_HEADS // NUM_KV_HEADS
    k = key.double().repeat_interleave(group, dim=1).transpose(0, 1)
    v = value.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q @ k.transpose(1, 2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    for i in range(q.shape[1]):
        pos = num_computed + i
        for j in range(k.shape[1]):
            too_far = sliding_window is not None and j <= pos - sliding_window
            if j > pos or too_far:
                scores[:, i, j] = float("-inf")
    weights = scores.exp()
    denominator = weights.sum(-1, keepdim=True)
    if sinks is not None:
        denominator = denominator + sinks.double().exp().view(-1, 1, 1)
    return (weights / denominator @ v).transpose(0, 1).float()


def run_paged_batch(requests, block_size, num_blocks, seed, sliding_window=None, softcap=None,
                    sinks=None):
    """Fill a paged cache with each request's full K/V, run paged attention on the new tokens,
    and compare with the dense reference. requests: [(num_computed, num_new)]."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    physical = list(range(num_blocks))
    rng.shuffle(physical)  # blocks deliberately out of order
    key_cache, value_cache = allocate_kv_cache(
        1, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, torch.float32)[0]
    batch, keys, values, queries = [], [], [], []
    for num_computed, num_new in requests:
        ctx_len = num_computed + num_new
        blocks = [physical.pop() for _ in range(cdiv(ctx_len, block_size))]
        batch.append((num_computed, num_new, blocks))
        keys.append(torch.randn(ctx_len, NUM_KV_HEADS, HEAD_DIM, generator=gen))
        values.append(torch.randn(ctx_len, NUM_KV_HEADS, HEAD_DIM, generator=gen))
        queries.append(torch.randn(num_new, NUM_HEADS, HEAD_DIM, generator=gen))
    # The cached context is written in an earlier "step", the new tokens in this one.
    past, _ = build_attn_metadata([(0, c, b) for c, _, b in batch], block_size)
    write_kv(torch.cat([k[:c] for k, (c, _, _) in zip(keys, batch)]),
             torch.cat([v[:c] for v, (c, _, _) in zip(values, batch)]),
             key_cache, value_cache, past.slot_mapping)
    metadata, _ = build_attn_metadata(batch, block_size)
    write_kv(torch.cat([k[c:] for k, (c, _, _) in zip(keys, batch)]),
             torch.cat([v[c:] for v, (c, _, _) in zip(values, batch)]),
             key_cache, value_cache, metadata.slot_mapping)
    scale = HEAD_DIM**-0.5
    out = paged_attention(torch.cat(queries), key_cache, value_cache, metadata, scale,
                          sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    starts = metadata.query_start_loc_cpu
    for b, (num_computed, _, _) in enumerate(batch):
        expected = dense_reference(queries[b], keys[b], values[b], num_computed, scale,
                                   sliding_window, softcap, sinks)
        torch.testing.assert_close(out[starts[b]:starts[b + 1]], expected, atol=1e-5, rtol=1e-5)


def test_write_kv_puts_each_token_at_its_slot():
    key_cache, value_cache = allocate_kv_cache(1, 4, 2, NUM_KV_HEADS, HEAD_DIM, torch.float32)[0]
    key = torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    write_kv(key, -key, key_cache, value_cache, torch.tensor([5, 0, 2]))
    torch.testing.assert_close(key_cache[2, 1], key[0])
    torch.testing.assert_close(key_cache[0, 0], key[1])
    torch.testing.assert_close(value_cache[1, 0], -key[2])


def test_mixed_batch_prefill_after_context_with_decodes():
    # A chunk after cached context, a fresh prefill, and decodes at block edges.
    requests = [(9, 6), (0, 7), (4, 1), (7, 1), (0, 1), (13, 1)]
    run_paged_batch(requests, block_size=4, num_blocks=40, seed=0)


def test_only_decodes_and_only_one_prefill():
    run_paged_batch([(3, 1), (16, 1), (1, 1)], block_size=4, num_blocks=20, seed=1)
    run_paged_batch([(0, 11)], block_size=4, num_blocks=5, seed=2)


@pytest.mark.parametrize("window", [1, 3, 5])
def test_sliding_window(window):
    run_paged_batch([(6, 5), (9, 1), (0, 8)], block_size=2, num_blocks=40, seed=3,
                    sliding_window=window)


@pytest.mark.parametrize("window", [None, 3])
def test_soft_capped_scores(window):
    # A cap small enough next to the scores (about N(0, 1)) that tanh bends most of them.
    requests = [(6, 5), (9, 1), (0, 8), (3, 1)]
    run_paged_batch(requests, block_size=2, num_blocks=40, seed=4, sliding_window=window,
                    softcap=0.7)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("softcap", [None, 0.7])
def test_attention_sinks(window, softcap):
    """gpt-oss's sinks (one logit per query head, about as large as the scores), with and without
    a window and a cap: chunks after context, fresh prefills and decodes."""
    sinks = torch.tensor([-1.0, 0.0, 0.8, 2.0])
    requests = [(6, 5), (9, 1), (0, 8), (3, 1), (0, 1)]
    run_paged_batch(requests, block_size=2, num_blocks=40, seed=5, sliding_window=window,
                    softcap=softcap, sinks=sinks)


@settings(max_examples=25, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), min_size=1, max_size=5),
    block_size=st.sampled_from([1, 2, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_matches_dense_reference_on_random_batches(requests, block_size, seed):
    needed = sum(cdiv(c + n, block_size) for c, n in requests)
    run_paged_batch(requests, block_size, num_blocks=needed + 3, seed=seed)


def test_kv_cache_allocation_and_size():
    caches = allocate_kv_cache(3, 5, 16, 2, 64, torch.bfloat16)
    assert len(caches) == 3
    key_cache, value_cache = caches[0]
    assert key_cache.shape == (5, 16, 2, 64) and key_cache.dtype == torch.bfloat16
    assert key_cache.data_ptr() != value_cache.data_ptr()
    assert kv_cache_bytes_per_block(3, 16, 2, 64, torch.bfloat16) == 2 * 3 * 16 * 2 * 64 * 2
