"""Limits, each answered in OpenAI's error shape: body size (413, with or without
Content-Length), n, logprobs, stop strings and ids, prompts per request, max_tokens against
max_model_len, and the waiting queue (a fast 503 with Retry-After, never an unbounded queue)."""

from __future__ import annotations

import asyncio
import json
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from pagedllm.sampling_params import MAX_LOGPROBS, MAX_N, MAX_STOP_STRING_LEN, MAX_STOP_STRINGS
from pagedllm.server.protocol import MAX_PROMPTS_PER_REQUEST, MAX_STOP_TOKEN_IDS
from tests.conftest import await_for, wait_for
from tests.server.conftest import RunningServer, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_BODY_BYTES = 4096


@pytest.fixture(scope="module")
def limits_server(tiny_model_dir, one_torch_thread):
    config = tiny_config(tiny_model_dir)  # max_model_len 64
    with RunningServer(config, max_body_bytes=MAX_BODY_BYTES) as running:
        yield running


def assert_openai_error(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error
    return error


def assert_still_serving(server) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    ok = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


# -- body size ----------------------------------------------------------------------------------

def big_body(size: int) -> bytes:
    body = json.dumps({"prompt": "hi", "max_tokens": 2, "user": "x" * size}).encode()
    assert len(body) > size
    return body


def test_body_over_the_limit_with_content_length(limits_server):
    response = httpx.post(f"{limits_server.base_url}/v1/completions", content=big_body(MAX_BODY_BYTES),
                          headers={"Content-Type": "application/json"})
    error = assert_openai_error(response, 413, str(MAX_BODY_BYTES))
    assert error["code"] == "request_too_large"
    assert_still_serving(limits_server)


@pytest.mark.parametrize("size", [MAX_BODY_BYTES, 20 * MAX_BODY_BYTES])
def test_body_over_the_limit_in_chunks_without_content_length(limits_server, size):
    body = big_body(size)

    def chunks():  # a generator body goes out with Transfer-Encoding: chunked
        for start in range(0, len(body), 1000):
            yield body[start:start + 1000]

    response = httpx.post(f"{limits_server.base_url}/v1/completions", content=chunks(),
                          headers={"Content-Type": "application/json"})
    assert "content-length" not in response.request.headers
    assert_openai_error(response, 413, str(MAX_BODY_BYTES), "chunks")
    assert_still_serving(limits_server)


def test_chunked_body_under_the_limit_is_served(limits_server):
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    response = httpx.post(f"{limits_server.base_url}/v1/completions", content=iter([body[:5], body[5:]]),
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


# -- per-request limits ---------------------------------------------------------------------------

@pytest.mark.parametrize("body,param,words", [
    ({"prompt": "hi", "n": MAX_N + 1}, "n", ["n must", str(MAX_N)]),
    ({"prompt": "hi", "logprobs": MAX_LOGPROBS + 1}, "logprobs", ["logprobs", str(MAX_LOGPROBS)]),
    ({"prompt": "hi", "stop": ["a"] * (MAX_STOP_STRINGS + 1)}, "stop", ["stop", str(MAX_STOP_STRINGS)]),
    ({"prompt": "hi", "stop": "x" * (MAX_STOP_STRING_LEN + 1)}, "stop", ["stop", str(MAX_STOP_STRING_LEN)]),
    ({"prompt": "hi", "stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids",
     ["stop_token_ids", str(MAX_STOP_TOKEN_IDS)]),
    ({"prompt": ["hi"] * (MAX_PROMPTS_PER_REQUEST + 1)}, "prompt", [str(MAX_PROMPTS_PER_REQUEST)]),
    ({"prompt": "hi", "max_tokens": 63}, "max_tokens", ["'max_tokens' is too large: 63", "64 tokens"]),
    ({"prompt": "x" * 64}, "prompt", ["maximum context length is 64", "64"]),
    # Too long to fit whatever it tokenizes to: refused before tokenizing (7 = "<|bos|>").
    ({"prompt": "x" * 1000}, "prompt", ["1000 characters", f"at most {64 * 7} characters"]),
    ({"prompt": "hi", "max_tokens": 2**70}, "max_tokens", ["max_tokens"]),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", ["max_tokens"]),
])
def test_completion_limits(limits_server, body, param, words):
    response = httpx.post(f"{limits_server.base_url}/v1/completions", json=body)
    error = assert_openai_error(response, 400, *words)
    assert error["param"] == param
    assert_still_serving(limits_server)


@pytest.mark.parametrize("fields,param", [
    ({"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
    ({"n": MAX_N + 1}, "n"),
    ({"max_completion_tokens": 1000}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "y" * 1000}]}, "messages"),
    ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
])
def test_chat_limits(limits_server, fields, param):
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    error = assert_openai_error(httpx.post(f"{limits_server.base_url}/v1/chat/completions", json=body), 400)
    assert error["param"] == param


def test_limits_at_the_edge_are_served(limits_server):
    prompt_tokens = len("hi")  # the tiny tokenizer: one token a byte
    body = {"prompt": "hi", "n": 2, "logprobs": MAX_LOGPROBS, "stop": ["a"] * MAX_STOP_STRINGS,
            "stop_token_ids": [299] * MAX_STOP_TOKEN_IDS, "max_tokens": 64 - prompt_tokens,
            "temperature": 0}
    response = httpx.post(f"{limits_server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2


# -- the waiting queue ----------------------------------------------------------------------------

@contextmanager
def stalled_core(server: RunningServer, tmp_path: Path):
    """Hold the core inside its next model step until the context ends, so requests pile up in
    front of it; yields a function that waits until it holds."""
    stalled, release = tmp_path / "stalled", tmp_path / "release"
    server.debug("stall_steps", stalled_path=str(stalled), release_path=str(release))

    def wait_stalled() -> None:
        wait_for(stalled.exists, "the core to hold its model step")

    try:
        yield wait_stalled
    finally:
        release.touch()
        server.debug("restore")


def test_full_waiting_queue_gives_a_fast_503_with_retry_after(tiny_model_dir, tmp_path):
    config = tiny_config(tiny_model_dir, max_num_seqs=1)
    with RunningServer(config, async_engine_kwargs={"max_waiting_requests": 2}) as server:
        body = {"prompt": "hello", "max_tokens": 3}

        async def storm():
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
                with stalled_core(server, tmp_path) as wait_stalled:
                    running = asyncio.ensure_future(client.post("/v1/completions", json=body))
                    await asyncio.to_thread(wait_stalled)  # the first request is in a step
                    waiting = [asyncio.ensure_future(client.post("/v1/completions", json=body))
                               for _ in range(2)]
                    await await_for(lambda: server.async_engine.num_waiting >= 2,
                                    "two requests waiting in front of the stalled core")
                    refused = await client.post("/v1/completions", json=body)
                    several = await client.post("/v1/completions", json={**body, "prompt": ["a", "b"]})
                    streamed = await client.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "hi"}], "stream": True})
                    # Answered while the queue is still stuck: nothing waited for a slot.
                    assert not running.done() and not any(w.done() for w in waiting)
                return refused, several, streamed, await running, await asyncio.gather(*waiting)

        refused, several, streamed, running, waiting = asyncio.run(storm())
        for response in (refused, several, streamed):
            error = assert_openai_error(response, 503, "overloaded", "limit is 2")
            assert error["type"] == "service_unavailable" and error["code"] == "server_overloaded"
            assert response.headers["retry-after"] == "1"
        assert running.status_code == 200 and all(w.status_code == 200 for w in waiting)
        assert server.async_engine.num_rejected_requests == 3
        assert server.wait_idle().kv.num_used_blocks == 0
        assert server.async_engine.num_waiting == 0
        assert httpx.post(f"{server.base_url}/v1/completions", json=body).status_code == 200
