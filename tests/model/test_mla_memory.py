"""Latent attention's KV pages hold the latent only: a token costs kv_lora_rank + qk_rope_head_dim
values per layer (one cache read as keys and values), which the plan and memory_stats() count."""

from __future__ import annotations

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.attention import allocate_kv_cache, kv_cache_bytes_per_block


def test_one_cache_serves_as_keys_and_values():
    caches = allocate_kv_cache(2, 4, 8, 1, 40, torch.float32, values_share_keys=True)
    assert all(keys is values for keys, values in caches)
    assert kv_cache_bytes_per_block(2, 8, 1, 40, torch.float32, values_share_keys=True) == 2 * 8 * 40 * 4
    for kind in ("int8", "fp8"):
        compressed = allocate_kv_cache(2, 4, 8, 1, 40, torch.float32, kv_cache_dtype=kind,
                                       values_share_keys=True)
        assert all(keys is values for keys, values in compressed)


def test_the_engine_plans_latent_bytes_per_token(tiny_checkpoint):
    checkpoint = tiny_checkpoint("deepseek_v2_mla")  # 3 layers, latent 32 + rotary key 8
    llm = LLM(model=str(checkpoint.folder), dtype="float32", block_size=4, kv_cache_memory="1MiB",
              max_model_len=64)
    latent_bytes_per_token = 3 * (32 + 8) * 4
    assert llm.engine.kv_plan.bytes_per_block == 4 * latent_bytes_per_token
    # The same 1 MiB holds twice the tokens it would if keys and values were kept apart.
    assert llm.engine.kv_plan.num_blocks == 2**20 // (4 * latent_bytes_per_token)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}],
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
