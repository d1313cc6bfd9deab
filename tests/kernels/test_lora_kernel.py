"""The compiled LoRA kernel (csrc/lora.cpp): every token's own adapter's update in one call, equal
to the torch path (two matmuls per adapter over its tokens) within fp32 sums, on every tier."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import tiers
from pagedllm.lora.layers import LoRALinear, LoRAState


def wrapped(max_loras: int, rank: int, part_rows: list[int], in_features: int, dtype: torch.dtype):
    """A LoRALinear over a float linear layer, every slot filled with a random adapter."""
    gen = torch.Generator().manual_seed(rank)
    base = torch.nn.Linear(in_features, sum(part_rows), bias=False).to(dtype)
    state = LoRAState()
    layer = LoRALinear(base, part_rows, in_features, state, max_loras, rank, torch.zeros(1))
    for slot in range(max_loras):
        parts = {p: (torch.randn(rank - p % 2, in_features, generator=gen),  # parts of smaller rank too
                     torch.randn(rows, rank - p % 2, generator=gen)) for p, rows in enumerate(part_rows)}
        layer.set_slot(slot, parts, scaling=0.5)
    return layer, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [[0], [-1, 2, 2, 0, -1, 3, 1, 2], list(range(16)) * 2, [-1, -1]])
def test_kernel_equals_the_segmented_matmuls(tier, dtype, slots):
    layer, state = wrapped(16 if max(slots) >= 4 else 4, 8, [48, 16, 16], 64, dtype)
    assert layer.kernel is not None and tiers.current().tier == tier
    x = torch.randn(len(slots), 64).to(dtype)
    state.set_batch(slots)
    compiled = layer(x)
    layer.kernel = None  # the torch path
    reference = layer(x)
    base = layer.base(x)
    assert torch.equal(compiled[torch.tensor(slots) < 0], base[torch.tensor(slots) < 0])
    # The update in fp32 either way; only the order of its sums (and y's one rounding) differ.
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-5)
    torch.testing.assert_close(compiled, reference, **tolerance)


def test_a_slot_past_the_slots_is_refused(tier):
    layer, state = wrapped(2, 4, [8], 16, torch.float32)
    state.set_batch([0, 5])
    with pytest.raises(RuntimeError, match="slot 5 of token 1 is past the 2 slots"):
        layer(torch.randn(2, 16))
