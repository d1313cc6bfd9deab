"""The fused elementwise CPU ops of every compiled tier this CPU runs against the torch code they
replace in model/llama.py, and the prepacked bf16 matmul weights against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import elementwise, tiers
from pagedllm.model.llama import RMSNorm
from pagedllm.model.packed_linear import PackedLinear, can_pack
from pagedllm.model.rope import apply_rotary

needs_kernel = pytest.mark.skipif(not tiers.available(),
                                  reason=f"CPU kernels unavailable: {tiers.unavailable_reason()}")
DTYPES = [torch.float32, torch.bfloat16]


def close(got, expected):
    # bf16: the same roundings as the torch path; only one fp32 sum differs in order.
    tol = dict(atol=1e-5, rtol=1e-5) if got.dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(got, expected, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,features", [(1, 576), (37, 64), (300, 100), (5, 8)])
def test_rms_norm(tier, dtype, rows, features):
    norm = RMSNorm(features, 1e-5).to(dtype)
    norm.weight.data = torch.randn(features).to(dtype)
    x = torch.randn(rows, features).to(dtype) * 3
    close(elementwise.rms_norm(x, norm.weight, 1e-5), norm._norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_in_place(tier, dtype):
    norm = RMSNorm(576, 1e-6).to(dtype)
    norm.weight.data = torch.randn(576).to(dtype)
    x, residual = torch.randn(70, 576).to(dtype), torch.randn(70, 576).to(dtype)
    expected_residual = x + residual
    expected = norm._norm(expected_residual)
    out, new_residual = norm(x.clone(), residual)
    assert new_residual is residual  # updated in place
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,first,count,head_dim", [(1, 0, 12, 64), (1, 12, 4, 64), (7, 2, 3, 16),
                                                         (40, 0, 1, 128), (3, 5, 0, 8)])
def test_rms_norm_heads_in_place_equals_rms_norm_over_the_heads(tier, dtype, tokens, first, count, head_dim):
    """Qwen3's q/k norms on the fused q/k/v rows: exactly rms_norm over the heads taken as rows,
    written back in place; the columns around them untouched."""
    width = (first + count + 2) * head_dim
    rows = (torch.randn(tokens, width) * 3).to(dtype)
    weight = torch.randn(head_dim).to(dtype)
    start, end = first * head_dim, (first + count) * head_dim
    expected = rows.clone()
    heads = rows[:, start:end].reshape(-1, head_dim)
    expected[:, start:end] = elementwise.rms_norm(heads, weight, 1e-6).view(tokens, end - start)
    elementwise.rms_norm_heads_(rows, first, count, head_dim, weight, 1e-6)
    torch.testing.assert_close(rows, expected, atol=0, rtol=0)


def test_rms_norm_heads_refuses_heads_past_the_row(tier):
    with pytest.raises(RuntimeError, match="past the rows"):
        elementwise.rms_norm_heads_(torch.randn(2, 128), 1, 2, 64, torch.randn(64), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (33, 40), (200, 64)])
def test_silu_and_mul(tier, dtype, rows, inter):
    gate_up = (torch.randn(rows, 2 * inter) * 4).to(dtype)
    gate, up = gate_up.split(inter, dim=-1)
    close(elementwise.silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 16), (2, 1, 128), (3, 3, 8)])
def test_rotary_in_place(tier, dtype, heads, kv_heads, head_dim):
    tokens = 23
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    angles = torch.rand(tokens, head_dim // 2) * 50
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    expected_q = apply_rotary(q.reshape(tokens, heads, head_dim), cos, sin)
    expected_k = apply_rotary(k.reshape(tokens, kv_heads, head_dim), cos, sin)
    expected_v = v.clone()
    elementwise.rotary_(qkv, cos, sin, heads + kv_heads, head_dim)
    close(q.reshape(tokens, heads, head_dim), expected_q)
    close(k.reshape(tokens, kv_heads, head_dim), expected_k)
    torch.testing.assert_close(v, expected_v, atol=0, rtol=0)  # v untouched


@pytest.mark.skipif(not can_pack(64), reason="this torch build cannot prepack bf16 linear weights")
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_equals_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 576, generator=gen).to(torch.bfloat16)
    bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    # Another kernel, another fp32 summation order (and the bias added before the one rounding):
    # a few elements may come out one bf16 step apart.
    for b in (None, bias):
        torch.testing.assert_close(PackedLinear(weight, b, 2048)(x), F.linear(x, weight, b),
                                   atol=1e-1, rtol=8e-3)
