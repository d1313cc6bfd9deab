"""The official openai client against a live server: completions and chat, streamed or not."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL_NAME, RunningServer

PROMPT = "The capital of France is"


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_models_health_version(server):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert "version" in httpx.get(f"{server.base_url}/version").json()
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_continuous_usage_stats_count_up_to_the_final_usage(server):
    chunks = list(client(server).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages)
    completion = [u.completion_tokens for u in usages]
    assert completion == sorted(completion) and completion[-1] == usages[-1].completion_tokens > 0
    assert len({u.prompt_tokens for u in usages}) == 1
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)
    text_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert text_chunks and text_chunks[-1].usage.completion_tokens <= usages[-1].completion_tokens


def test_completion_streamed_equals_non_streamed(server):
    c = client(server)
    full = c.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0)
    assert "Paris" in full.choices[0].text
    assert full.usage.completion_tokens == 16 or full.choices[0].finish_reason == "stop"
    chunks = c.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                                  stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in chunks:
        if chunk.usage:
            usage = chunk.usage
        pieces.extend(choice.text for choice in chunk.choices)
    assert "".join(pieces) == full.choices[0].text
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_chat_streamed_equals_non_streamed(server):
    c = client(server)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = c.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=20,
                                     temperature=0)
    text = full.choices[0].message.content
    assert "Paris" in text
    stream = c.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=20,
                                       temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == text


def test_async_client(server):
    async def run():
        c = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        full = await c.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
        stream = await c.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
            temperature=0, stream=True)
        pieces = [ch.choices[0].delta.content or "" async for ch in stream if ch.choices]
        await c.close()
        return full, pieces

    full, pieces = asyncio.run(run())
    assert full.choices[0].text
    assert "".join(pieces)


def test_n_logprobs_and_several_prompts(server):
    c = client(server)
    out = c.completions.create(model=MODEL_NAME, prompt=[PROMPT, "Hello"], max_tokens=4, n=2,
                               temperature=1.0, seed=3, logprobs=3)
    assert sorted(ch.index for ch in out.choices) == [0, 1, 2, 3]
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) >= 1 for top in lp.top_logprobs)
    chat = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                     max_tokens=3, logprobs=True, top_logprobs=2, temperature=0)
    content = chat.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 2 for t in content)


def test_32_concurrent_streams_get_their_solo_text_in_shared_batches(server):
    prompts = [f"Count from {i} to {i + 5}:" for i in range(32)]
    c = client(server)
    solo = {p: c.completions.create(model=MODEL_NAME, prompt=p, max_tokens=12, temperature=0).choices[0].text
            for p in prompts[:4]}
    before = server.async_engine.max_batch_requests

    async def one(ac, prompt):
        stream = await ac.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12,
                                             temperature=0, stream=True)
        return "".join([ch.choices[0].text async for ch in stream if ch.choices])

    async def run():
        ac = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        texts = await asyncio.gather(*(one(ac, p) for p in prompts))
        await ac.close()
        return texts

    server.async_engine.max_batch_requests = 0
    texts = asyncio.run(run())
    for prompt, text in zip(prompts[:4], texts[:4]):
        assert text == solo[prompt]
    # Requests from different HTTP clients ran in one batch.
    assert server.async_engine.max_batch_requests >= 8
    server.async_engine.max_batch_requests = max(before, server.async_engine.max_batch_requests)


def test_client_disconnect_frees_its_blocks(server):
    with httpx.stream("POST", f"{server.base_url}/v1/completions",
                      json={"prompt": PROMPT, "max_tokens": 500, "stream": True, "ignore_eos": True},
                      timeout=30) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i >= 6:
                break  # hang up mid-stream
    snap = server.wait_idle()
    assert snap.kv.usage == 0
    assert snap.kv.num_free_blocks == snap.kv.num_blocks
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert "pagedllm:kv_cache_usage_perc 0.0" in metrics


def test_metrics_names(server):
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "kv_cache_blocks_total", "kv_cache_blocks_free", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "prefix_cache_hit_rate", "kv_cache_blocks_cached_free",
                 "time_to_first_token_seconds_bucket", "time_per_output_token_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "kv_cache_bytes_per_block"]:
        assert f"pagedllm:{name}" in text, name
    assert 'pagedllm:kv_cache_info{kv_cache_dtype="float32"} 1.0' in text


def test_api_key_guards_v1_only(server_config):
    with RunningServer(server_config, api_key=API_KEY) as s:
        assert httpx.get(f"{s.base_url}/v1/models").status_code == 401
        wrong = httpx.get(f"{s.base_url}/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        ok = httpx.get(f"{s.base_url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200
        assert httpx.get(f"{s.base_url}/health").status_code == 200
        assert httpx.get(f"{s.base_url}/metrics").status_code == 200


@pytest.mark.parametrize("body,status,words", [
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": []}, 400, "empty"),
    ({"prompt": [1, 2, 99999999]}, 400, "vocabulary"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 2}, 400, "top_p"),
    ({"prompt": "hi", "n": 0}, 400, "n must"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "does not exist"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"max_tokens": 3}, 400, "prompt"),
])
def test_bad_completion_input(server, body, status, words):
    response = httpx.post(f"{server.base_url}/v1/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert httpx.get(f"{server.base_url}/health").status_code == 200


@pytest.mark.parametrize("body,words", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "", "content": "hi"}]}, "role"),  # any other role goes to the template
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 30, "logprobs": True},
     "top_logprobs"),
])
def test_bad_chat_input(server, body, words):
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"42", b"null", b'"text"'])
def test_body_that_is_not_a_json_object(server, raw):
    response = httpx.post(f"{server.base_url}/v1/completions", content=raw,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"]
    assert httpx.get(f"{server.base_url}/health").status_code == 200
