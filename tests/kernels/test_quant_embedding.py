"""The compiled quantized embedding lookup (csrc/quant_embedding.cpp) of every compiled tier against
the torch path it replaces (QuantizedWeight.select_rows, then dequantize), on plain and
row-interleaved tables."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import matmul
from pagedllm.model.quant_linear import QuantEmbedding
from pagedllm.model.quant_weight import quantize

IDS = torch.tensor([5, 0, 47, 5, 16, 31, 17])  # repeats, both ends, across the groups of 16 rows


def tables(bits: int, group_size: int):
    """A random table of 48 rows, plain, and row-interleaved where that layout takes it."""
    gen = torch.Generator().manual_seed(bits * 1000 + group_size)
    plain = quantize(torch.randn(48, 128, generator=gen), bits, group_size)
    return [plain] + ([plain.interleave()] if plain.interleavable() else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,group_size", [(8, 32), (8, 64), (8, 16), (4, 32), (4, 64)])
def test_lookup_equals_the_torch_rows(tier, dtype, bits, group_size):
    layouts = tables(bits, group_size)
    reference = layouts[0].dequantize(torch.float32)[IDS].to(dtype)
    for table in layouts:
        embedding = QuantEmbedding(table, dtype)
        assert embedding.cpu_kernel
        rows = embedding(IDS.view(1, -1))
        assert rows.shape == (1, len(IDS), 128) and rows.dtype == dtype
        assert torch.equal(rows[0], reference), f"interleaved={table.interleaved}"
        assert torch.equal(table.select_rows(IDS).dequantize(dtype), reference)


def test_interleaved_tables_are_tested():
    assert len(tables(8, 32)) == 2 and len(tables(4, 32)) == 2


@pytest.mark.parametrize("bad", [48, -1])
def test_an_id_outside_the_table_is_refused(tier, bad):
    for table in tables(8, 32):
        with pytest.raises(RuntimeError, match=f"id {bad} outside the table's 48 rows"):
            matmul.quant_embedding(table, torch.tensor([0, bad]), torch.float32)
