"""The portable tier's quantized matmul (pagedllm/model/torch_int4_linear.py): torch's int4
kernel over our layouts repacked at load, against QuantLinear's oracle (tiles dequantized)."""

from __future__ import annotations

import gguf
import pytest
import torch

from pagedllm.model import torch_int4_linear
from pagedllm.model.gguf_repack import repack
from pagedllm.model.quant_linear import QuantEmbedding, QuantLinear
from pagedllm.model.quant_weight import quantize
from pagedllm.model.torch_int4_linear import TorchInt4Linear, pack_for_torch, packable
from tests.kernel_tiers import kernel_tier
from tests.model.quant_blocks import random_blocks

Q = gguf.GGMLQuantizationType
# Types whose repacked layout torch's kernel takes (4-bit linear codebooks, int8 codes, groups of 32).
PACKABLE = (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K)
ROWS, COLS = 80, 256  # 80 rows: not a multiple of 64, the row block of the kernel's packing


def gguf_weight(qtype: Q, rows: int = ROWS, cols: int = COLS, seed: int = 0):
    return repack(qtype, random_blocks(qtype, rows, cols, seed=seed), (rows, cols))


def halves(part) -> list[torch.Tensor]:
    """The float32 weights torch's kernel multiplies for part, as the module docstring maps it,
    with scales and zeros rounded to bf16: one matrix for 4-bit codes, the hi and lo halves for
    int8 ones (their sum is the weight)."""
    n, k = part.shape
    values = part.values().view(n, -1, part.group_size)
    s = part.scales.float()[..., None]
    m = 0 if part.mins is None else part.mins.float()[..., None]

    def torch_weight(codes, scale, zero):
        bf16 = torch.bfloat16
        return ((codes - 8) * scale.to(bf16).float() + torch.as_tensor(zero).to(bf16).float()).view(n, k)
    if part.bits == 4:
        base = float(part.codebook[0])
        return [torch_weight(values - base, s, s * (8 + base) + m)]
    hi = torch.floor(values / 16)
    return [torch_weight(hi + 8, 16 * s, torch.zeros_like(s)), torch_weight(values - 16 * hi, s, 8 * s + m)]


def matches(linear: QuantLinear, out: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether out is x times the weights torch's kernel holds (halves), up to bf16's rounding of
    each half's output and of their sum; and those weights are gguf's values up to bf16's rounding
    of scales and zeros."""
    expected = torch.zeros_like(out, dtype=torch.float32)
    start, bound = 0, torch.zeros_like(expected)
    for part in linear.parts:
        pieces = halves(part)
        weight = part.dequantize(torch.float32)
        if not torch.allclose(sum(pieces), weight, rtol=0, atol=2.0 ** -7 * float(weight.abs().max())):
            return False
        cols = slice(start, start + part.shape[0])
        for piece in pieces:
            y = x.float() @ piece.t()
            expected[:, cols] += y
            # Rounded once on output, and each weight rounded to bf16 inside the kernel (its
            # error then scales with sum |x| |w|, not with |y|, which cancellation makes small).
            bound[:, cols] += 2.0 ** -8 * y.abs() + 2.0 ** -9 * (x.float().abs() @ piece.abs().t())
        start += part.shape[0]
    if linear.bias is not None:
        expected += linear.bias.to(torch.bfloat16).float()
    bound += 2.0 ** -8 * expected.abs()
    return bool(((out.float() - expected).abs() <= bound).all())


def assert_matches_oracle(linear: QuantLinear, rows: int) -> None:
    x = torch.randn(rows, linear.in_features, generator=torch.Generator().manual_seed(rows))
    x = x.to(torch.bfloat16)
    out = TorchInt4Linear(linear)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, linear.out_features)
    assert matches(linear, out, x)
    # And against the oracle (float32 tiles of gguf's values): within bf16's reach.
    reference = linear.portable(x.float())
    atol = 2.0 ** -6 * float(reference.abs().max())
    assert torch.allclose(out.float(), reference, rtol=2.0 ** -5, atol=atol)


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_gguf_types_match_the_oracle(qtype, rows):
    weight = gguf_weight(qtype)
    assert packable(weight)
    assert_matches_oracle(QuantLinear([weight]), rows)


@pytest.mark.parametrize("bits,group_size", [(8, 32), (8, 64), (4, 32), (4, 128), (4, 256)])
def test_quantized_at_load_matches_the_oracle(bits, group_size):
    weight = torch.randn(48, 512, generator=torch.Generator().manual_seed(bits))
    assert_matches_oracle(QuantLinear([quantize(weight, bits, group_size)]), rows=3)


def test_fused_parts_of_different_layouts_and_a_bias():
    """q/k in Q4_K and v in Q8_0 (two parts, one of them split in halves), with a bias."""
    parts = [gguf_weight(Q.Q4_K, 32, 256, seed=1), gguf_weight(Q.Q4_K, 16, 256, seed=2),
             gguf_weight(Q.Q8_0, 16, 256, seed=3)]
    linear = QuantLinear(parts, torch.randn(64, generator=torch.Generator().manual_seed(4)))
    assert len(linear.parts) == 2
    assert_matches_oracle(linear, rows=4)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_a_wrong_zero_is_seen(qtype):
    """The check is tight: zeros off by one scale (a wrong mapping) fail it."""
    linear = QuantLinear([gguf_weight(qtype)])
    wrong = TorchInt4Linear(linear)
    pack = wrong.packs[0]
    shifted = pack.scales_zeros.clone()
    shifted[..., 1] += shifted[..., 0]
    wrong.packs[0] = torch_int4_linear.Int4Pack(pack.weight, shifted, pack.group_size, pack.rows, pack.split)
    x = torch.randn(2, COLS).to(torch.bfloat16)
    assert matches(linear, TorchInt4Linear(linear)(x), x)
    assert not matches(linear, wrong(x), x)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_packing_in_chunks_is_the_whole_packing(qtype, monkeypatch):
    """pack() packs PACK_CHUNK_ROWS rows at a time: with chunks of 64 rows (the kernel's row block
    here or a multiple of it) the result is the packing of the whole weight at once."""
    weight = gguf_weight(qtype, rows=208)
    whole = torch_int4_linear.pack(weight)
    monkeypatch.setattr(torch_int4_linear, "PACK_CHUNK_ROWS", 64)
    assert torch.equal(torch_int4_linear.pack(weight).weight, whole.weight)


def test_what_is_not_packable():
    assert not packable(gguf_weight(Q.Q6_K))  # groups of 16
    assert not packable(gguf_weight(Q.IQ4_NL))  # a non-linear codebook
    assert not packable(gguf_weight(Q.Q4_0, rows=24))  # rows not a multiple of 16


def test_pack_for_torch_replaces_what_fits_and_keeps_shared_tables():
    """At load (prepack_for_cpu at the portable tier): packable projections replaced, the others
    kept; an embedding sharing its table with the head keeps its plain codes."""
    table = gguf_weight(Q.Q8_0, rows=64)
    model = torch.nn.Module()
    model.embed = QuantEmbedding(table, torch.bfloat16)
    model.head = QuantLinear([table])
    model.same_head = model.head  # one module under two names (an LM head and its kernel)
    model.odd = QuantLinear([gguf_weight(Q.Q6_K)])
    with kernel_tier("portable"):
        assert torch_int4_linear.runs_here(torch.bfloat16) and not torch_int4_linear.runs_here(torch.float32)
        assert pack_for_torch(model) == 1
    assert isinstance(model.head, TorchInt4Linear) and model.same_head is model.head
    assert type(model.odd) is QuantLinear
    assert model.embed.weight_q is table
    ids = torch.tensor([3, 60])
    assert torch.equal(model.embed(ids), table.dequantize(torch.bfloat16)[ids])


def test_a_gguf_model_at_the_portable_tier(tmp_path):
    """Loaded in bf16 at the portable tier, prepack_for_cpu moves the projections onto torch's
    kernel: the logits stay those of the tile path within bf16's reach, and the plain codes are
    dropped (the weights take no more bytes)."""
    from pagedllm.model.loader import load_model
    from tests.model.test_quantized_model import PROMPTS, _cache, quantized_gguf

    path, _ = quantized_gguf(tmp_path, [Q.Q4_1, Q.Q8_0, Q.Q4_0], hidden_size=256, intermediate_size=512)
    with kernel_tier("portable"):
        model = load_model(path, dtype="bfloat16").model
        tokens = torch.tensor(PROMPTS[3])

        def logits():
            caches, metadata = _cache(model, len(tokens), torch.bfloat16)
            return model.compute_logits(model(tokens, torch.arange(len(tokens)), caches, metadata))
        before, bytes_before = logits(), model.weight_bytes()
        model.prepack_for_cpu(16)
        packed = [m for m in model.modules() if isinstance(m, TorchInt4Linear)]
        assert len(packed) == 4 * model.config.num_hidden_layers  # qkv, o, gate_up, down
        assert [m for m in model.modules() if type(m) is QuantLinear] == [model.lm_head]  # 300 rows
        assert model.weight_bytes() <= bytes_before * 1.1
        after = logits()
    torch.testing.assert_close(after, before, rtol=0.05, atol=0.05 * float(before.abs().max()))
