"""Applying a bitmask to logits, against a plain loop over the bits: every width mismatch, row
subsets, dtypes, and the torch unpacking used off the CPU."""

import numpy as np
import pytest
import torch

from pagedllm.structured.bitmask import (
    allocate_token_bitmask,
    allowed_ids,
    apply_token_bitmask_,
    unpack_bitmask,
    unpack_bitmask_torch,
)
from pagedllm.structured.matcher import BitmaskFiller
from pagedllm.structured.spec import GrammarSpec


def random_bitmask(rows: int, vocab_size: int, density: float, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    bits = rng.random((rows, (vocab_size + 31) // 32 * 32)) < density
    bits[:, vocab_size:] = False  # as llguidance fills it: no bits past the vocabulary
    packed = np.packbits(bits.astype(np.uint8), axis=1, bitorder="little").view(np.int32)
    return torch.from_numpy(packed.copy())


def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    out = logits.clone()
    for r in range(out.shape[0]):
        for t in range(out.shape[1]):
            word = int(bitmask[r, t // 32]) if t < vocab_size else 0
            if not (word >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("logits_vocab", [300, 258, 200])  # padded lm_head, equal, narrower
@pytest.mark.parametrize("density", [0.0, 0.05, 0.5, 1.0])
def test_apply_matches_a_loop_over_the_bits(logits_vocab, density):
    vocab_size = 258  # the tiny tokenizer's
    bitmask = random_bitmask(3, vocab_size, density, seed=int(density * 100) + logits_vocab)
    logits = torch.randn(3, logits_vocab)
    expected = reference_apply(logits, bitmask, vocab_size)
    apply_token_bitmask_(logits, bitmask, vocab_size)
    assert torch.equal(logits, expected)


def test_model_rows_past_the_tokenizer_are_always_masked():
    logits = torch.zeros(2, 70)
    apply_token_bitmask_(logits, allocate_token_bitmask(2, 40), vocab_size=40)
    assert logits[:, :40].eq(0).all() and logits[:, 40:].isneginf().all()


def test_only_listed_rows_are_masked():
    bitmask = random_bitmask(2, 64, 0.3, seed=1)
    logits = torch.randn(5, 64)
    expected = logits.clone()
    expected[[4, 1]] = reference_apply(logits[[4, 1]], bitmask, 64)
    apply_token_bitmask_(logits, bitmask, 64, rows=[4, 1])
    assert torch.equal(logits, expected)
    with pytest.raises(ValueError, match="bitmask has 2 rows for 5 rows of logits"):
        apply_token_bitmask_(logits, bitmask, 64)


def test_bfloat16_logits_and_existing_infinities():
    bitmask = random_bitmask(4, 96, 0.5, seed=2)
    logits = torch.randn(4, 96).to(torch.bfloat16)
    logits[0, :3] = float("-inf")
    expected = reference_apply(logits.float(), bitmask, 96).to(torch.bfloat16)
    apply_token_bitmask_(logits, bitmask, 96)
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, expected)
    assert not logits.isnan().any()


def test_large_batches_go_through_in_chunks():
    vocab_size = 49_152  # SmolLM2's: a few rows per chunk
    bitmask = random_bitmask(9, vocab_size, 0.5, seed=3)
    logits = torch.randn(9, vocab_size)
    allowed = unpack_bitmask(bitmask, vocab_size)
    expected = logits.masked_fill(~allowed, float("-inf"))
    apply_token_bitmask_(logits, bitmask, vocab_size)
    assert torch.equal(logits, expected)


def test_numpy_and_torch_unpacking_agree():
    bitmask = random_bitmask(3, 1000, 0.4, seed=4)
    assert torch.equal(unpack_bitmask(bitmask, 1000), unpack_bitmask_torch(bitmask, 1000))
    assert unpack_bitmask(bitmask, 1000)[1].nonzero().flatten().tolist() == allowed_ids(bitmask[1], 1000)


def test_filled_rows_have_no_bits_past_the_vocabulary(tiny_compiler):
    matcher = tiny_compiler.matcher(GrammarSpec.regex("[a-z]+"))
    bitmask = torch.full((1, 9), -1, dtype=torch.int32)  # 258 tokens -> 9 words
    BitmaskFiller().fill(bitmask, [(matcher, 0)])
    assert unpack_bitmask(bitmask, 9 * 32)[0, 258:].sum() == 0
    assert allowed_ids(bitmask[0], 258) == list(range(ord("a"), ord("z") + 1))


def test_filler_threads_must_be_positive():
    with pytest.raises(ValueError, match="num_threads must be at least 1"):
        BitmaskFiller(num_threads=0)
