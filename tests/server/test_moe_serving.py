"""A mixture-of-experts model served: `pagedllm serve` on a tiny random Qwen3-MoE (and Qwen2-MoE,
with its gated shared expert) answers the official openai client, streamed and not, with the
tokens the offline engine gives (which tests/model/test_moe.py checks against transformers)."""

from __future__ import annotations

import openai
import pytest

from pagedllm import LLM, SamplingParams
from tests.model.tiny import make_hf_model, save_checkpoint
from tests.server.conftest import MODEL_NAME, RunningServer, tiny_config

PROMPTS = ["mixture of", "experts route each token to two of four"]


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "deepseek_v2_mla", "deepseek_v3_mla"])
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
