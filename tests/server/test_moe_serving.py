"""Mixture-of-experts models served: `pagedllm serve` on tiny random Qwen3-MoE, Qwen2-MoE (with its
gated shared expert), Mixtral, gpt-oss and DeepSeek-V2/V3 folders answers the official openai
client, streamed and not, with the tokens the offline engine gives (which tests/model/test_moe.py
checks against transformers); and served from llama.cpp's GGUF files and from the HF folders,
transformers' own greedy tokens through prefix-cache hits, preemption and n > 1."""

from __future__ import annotations

import openai
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.server.answer_options import AnswerOptions
from tests.model.test_llama_equivalence import token_ids
from tests.model.test_moe import hf_greedy
from tests.model.tiny import GGUF_OVERRIDES, make_hf_model, save_checkpoint, write_gguf
from tests.server.conftest import MODEL_NAME, RunningServer, tiny_config

PROMPTS = ["mixture of", "experts route each token to two of four"]


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "mixtral_moe", "gpt_oss", "deepseek_v2_mla",
                                        "deepseek_v3_mla"])
def moe_dir(request, tmp_path_factory):
    return save_checkpoint(make_hf_model(request.param), tmp_path_factory.mktemp(request.param))


def test_served_moe_text_equals_the_offline_engine(moe_dir, one_torch_thread):
    offline = LLM(model=str(moe_dir), dtype="float32", num_kv_blocks=64, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, params, use_tqdm=False)]
    with RunningServer(tiny_config(moe_dir)) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        for prompt, want in zip(PROMPTS, expected, strict=True):
            extra = {"ignore_eos": True}
            done = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12,
                                             temperature=0, extra_body=extra)
            assert done.choices[0].text == want
            stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12,
                                               temperature=0, stream=True, extra_body=extra)
            assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == want


@pytest.mark.parametrize("shape, source", [
    ("qwen3_moe", "gguf"), ("qwen2_moe", "gguf"), ("mixtral_moe", "gguf"), ("gpt_oss", "gguf"),
    ("qwen3_moe", "folder"), ("qwen2_moe", "folder"), ("mixtral_moe", "folder"), ("gpt_oss", "folder")])
def test_served_moe_gives_transformers_tokens_through_cache_hits_preemption_and_n(shape, source, tmp_path,
                                                                                  one_torch_thread):
    if source == "gguf":
        hf_model = make_hf_model(shape, seed=5, **GGUF_OVERRIDES.get(shape, {}))
        model = write_gguf(hf_model, tmp_path / "moe.gguf")
    else:
        hf_model = make_hf_model(shape, seed=5)
        model = save_checkpoint(hf_model, tmp_path / "folder")
    shared = token_ids(12, seed=50)
    prompts = [shared + token_ids(length, seed=51 + length) for length in (3, 7, 9, 5)]
    expected = [hf_greedy(hf_model, p, 10) for p in prompts]
    # As the offline test: 10 blocks of 4 cannot hold the three prompts' n=3 forks at once.
    config = tiny_config(model, block_size=4, num_kv_blocks=10, max_model_len=32, max_num_batched_tokens=16,
                         enable_prefix_caching=True)
    extra = {"ignore_eos": True, "return_token_ids": True}
    with RunningServer(config, options=AnswerOptions(prompt_tokens_details=True)) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        first = client.completions.create(model=MODEL_NAME, prompt=prompts[0], max_tokens=10, temperature=0,
                                          extra_body=extra)
        assert first.choices[0].token_ids == expected[0]
        batch = client.completions.create(model=MODEL_NAME, prompt=prompts[1:], max_tokens=10, temperature=0,
                                          n=3, extra_body=extra)
        choices = sorted(batch.choices, key=lambda c: c.index)  # prompt i's n choices: 3i, 3i+1, 3i+2
        by_prompt = [[c.token_ids for c in choices[3 * i:3 * i + 3]] for i in range(3)]
        assert by_prompt == [[want] * 3 for want in expected[1:]]
        assert batch.usage.prompt_tokens_details.cached_tokens > 0
        stream = client.completions.create(model=MODEL_NAME, prompt=prompts[2], max_tokens=10, temperature=0,
                                           n=3, stream=True, extra_body=extra)
        streamed: dict[int, list[int]] = {}
        for chunk in stream:
            for choice in chunk.choices:
                streamed.setdefault(choice.index, []).extend(choice.token_ids or [])
        assert streamed == {i: expected[2] for i in range(3)}
        stats = server.wait_idle()
    assert stats.num_preemptions > 0 and stats.kv.num_free_blocks == stats.kv.num_blocks
