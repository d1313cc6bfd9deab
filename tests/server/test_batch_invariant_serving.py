"""`--batch-invariant` through the server (issue 24): 200 greedy bf16 answers given under load,
with chunked prefill and preemption, are each the text (and the log-probabilities) the same
request gets alone. Without the mode the same run differs (see docs/reliability.md)."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from pagedllm.config import EngineConfig
from pagedllm.kernels import tiers
from tests.model.tiny import make_hf_model, save_checkpoint
from tests.server.conftest import RunningServer, metric_value

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not tiers.current().runs_layers,
                                 reason="batch-invariant mode needs the compiled CPU kernels")]

NUM_PROMPTS = 40
REPEATS = 5  # 200 answers under load
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def bf16_server(tmp_path_factory, one_torch_thread):
    model = make_hf_model("llama_gqa_untied", max_position_embeddings=512, hidden_size=128,
                          intermediate_size=256)
    folder = save_checkpoint(model, tmp_path_factory.mktemp("tiny_bf16_server"))
    # Too few blocks for the load (preemption), prompts cut into 64-token chunks.
    config = EngineConfig(model=str(folder), dtype="bfloat16", num_kv_blocks=30, block_size=16,
                          max_model_len=256, max_num_batched_tokens=64, enable_prefix_caching=False,
                          batch_invariant=True)
    with RunningServer(config) as running:
        yield running


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(256) for _ in range(rng.randrange(5, 150))] for _ in range(NUM_PROMPTS)]


async def answer(client: httpx.AsyncClient, prompt: list[int]) -> tuple[str, list[float]]:
    """The answer's text and its tokens' log-probabilities (as exact as JSON numbers are)."""
    response = await client.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "logprobs": 0})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


async def answers(base_url: str, batch: list[list[int]], concurrent: bool) -> list[tuple]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300,
                                 limits=httpx.Limits(max_connections=len(batch))) as client:
        if concurrent:
            return list(await asyncio.gather(*(answer(client, p) for p in batch)))
        return [await answer(client, p) for p in batch]


def test_bf16_greedy_answers_under_load_equal_their_solo_text(bf16_server):
    batch = prompts()
    solo = asyncio.run(answers(bf16_server.base_url, batch, concurrent=False))
    preemptions_before = metric_value(bf16_server.base_url, "num_preemptions_total")
    loaded = asyncio.run(answers(bf16_server.base_url, batch * REPEATS, concurrent=True))
    assert metric_value(bf16_server.base_url, "num_preemptions_total") > preemptions_before
    assert bf16_server.async_engine.max_batch_requests > 1
    texts = [i for i, (text, _) in enumerate(loaded) if text != solo[i % NUM_PROMPTS][0]]
    assert not texts, f"{len(texts)} of {len(loaded)} answers differ from their solo text"
    logprobs = [i for i, got in enumerate(loaded) if got != solo[i % NUM_PROMPTS]]
    assert not logprobs, f"{len(logprobs)} of {len(loaded)} answers' log-probabilities differ"
