"""A whole model, prefill then batched decodes through the paged cache, with the CPU kernels of each
tier this CPU runs (paged attention and the fused elementwise ops) and with the portable tier: the
same logits (fp32: to float rounding; bf16: to bf16 rounding) and, in fp32, the same greedy
tokens; on plain and on compressed KV caches."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model.loader import load_model

pytest.importorskip("transformers")

from tests.kernel_tiers import kernel_tier  # noqa: E402
from tests.model.paged import PagedSequences  # noqa: E402
from tests.model.tiny import make_hf_model, save_checkpoint  # noqa: E402

PROMPTS = [[5, 9, 20, 33, 41, 7, 7, 100, 3, 18, 2], [77, 1, 250], [12] * 19]


def generate(model, steps: int, kv_cache_dtype: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens and every step's logits: all prompts in one prefill step, then decodes."""
    paged = PagedSequences(model, num_blocks=64, block_size=4, kv_cache_dtype=kv_cache_dtype)
    logits = paged.step(dict(enumerate(PROMPTS)))
    all_logits = [torch.cat(list(logits.values()))]
    tokens = [[int(logits[i][-1].argmax())] for i in range(len(PROMPTS))]
    for _ in range(steps):
        logits = paged.step({i: out[-1:] for i, out in enumerate(tokens)})
        all_logits.append(torch.cat(list(logits.values())))
        for i, out in enumerate(tokens):
            out.append(int(logits[i][-1].argmax()))
    return tokens, all_logits


@pytest.mark.parametrize("shape", ["llama_gqa_untied", "qwen2_qkv_bias", "mistral_linear_rope_window",
                                   "qwen3_qk_norm", "gemma2_softcap_window", "phi3_longrope_window"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3"])
def test_kernels_and_torch_path_agree(tier, shape, dtype, kv_cache_dtype, tmp_path):
    """Each compiled tier this CPU runs against the portable tier, each model built under its tier."""
    folder = save_checkpoint(make_hf_model(shape), tmp_path / shape)
    model = load_model(folder, dtype=dtype).model
    assert model.config.head_dim in (16, 32, 64, 128, 256)  # a size the kernel takes
    fast_tokens, fast_logits = generate(model, steps=8, kv_cache_dtype=kv_cache_dtype)

    with kernel_tier("portable"):
        slow_model = load_model(folder, dtype=dtype).model
        slow_tokens, slow_logits = generate(slow_model, steps=8, kv_cache_dtype=kv_cache_dtype)

    tol = dict(atol=2e-4, rtol=2e-4) if dtype == "float32" else dict(atol=0.1, rtol=0.05)
    if dtype == "float32" and kv_cache_dtype != "auto":
        # The paths' float roundings upstream (rotary, norms) can move a K/V element across a
        # rounding boundary of its code: that element then differs by one quantization step.
        tol = dict(atol=5e-3, rtol=5e-3)
    if dtype == "float32":
        assert fast_tokens == slow_tokens
        for fast, slow in zip(fast_logits, slow_logits):
            torch.testing.assert_close(fast, slow, **tol)
    else:  # bf16 roundings differ between the paths: compare the prefill only, loosely
        torch.testing.assert_close(fast_logits[0], slow_logits[0], **tol)
