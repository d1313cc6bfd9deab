"""A hybrid model served: `pagedllm serve` on a tiny random Qwen3.5 (Gated DeltaNet layers and
gated attention) answers the openai client with transformers' greedy tokens, prompts prefilled in
chunks smaller than themselves and n=2 forks copying the recurrent state; /metrics counts the pool's
pages by kind, and the start-up line says why prefix caching is off."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.model.tiny import make_hf_model, save_checkpoint
from tests.server.conftest import MODEL_NAME, RunningServer, tiny_config

PROMPTS = ["a hybrid keeps a recurrent state", "per request"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    hf_model = make_hf_model("qwen3_5_hybrid")
    return hf_model, save_checkpoint(hf_model, tmp_path_factory.mktemp("qwen3_5-hybrid"))


def test_served_hybrid_gives_transformers_tokens(hybrid, one_torch_thread):
    hf_model, folder = hybrid
    config = tiny_config(folder, block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)
    with RunningServer(config) as server:
        assert "prefix caching is off for this model" in server.ready.description
        tokenizer = server.async_engine.input_processor.tokenizer
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt)
            with torch.no_grad():
                out = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                        min_new_tokens=MAX_TOKENS)
            want = tokenizer.decode(out[0, len(ids):].tolist())
            done = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=MAX_TOKENS,
                                             temperature=0, n=2, extra_body={"ignore_eos": True})
            assert [c.text for c in done.choices] == [want, want]
        stats = server.wait_idle()
        assert stats.kv.num_free_blocks == stats.kv.num_blocks
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert 'pagedllm:kv_cache_pages_in_use{kind="recurrent_state"} 0.0' in metrics
    assert 'pagedllm:kv_cache_pages_in_use{kind="full_attention"} 0.0' in metrics
