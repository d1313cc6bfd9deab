"""Overload and abort storm: many streaming clients against a KV cache far too small for them,
a third hanging up at random moments. Every client that stays gets exactly the greedy text it
gets alone; requests are preempted (and counted) along the way; afterwards no block is in use
and no request is left anywhere.

CI size runs in well under a minute on the tiny model; `make stress` sets
PAGEDLLM_STORM_REQUESTS (and friends) for a larger storm, past the server's waiting-queue
limit, so that the excess is refused at once (503, Retry-After) while the rest still complete.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re

import httpx
import pytest

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.server.protocol import DEFAULT_MAX_WAITING_REQUESTS
from tests.server.conftest import RunningServer, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_REQUESTS = int(os.environ.get("PAGEDLLM_STORM_REQUESTS", "300"))
NUM_PROMPTS = int(os.environ.get("PAGEDLLM_STORM_PROMPTS", "40"))  # distinct prompts, reused
MAX_TOKENS = int(os.environ.get("PAGEDLLM_STORM_MAX_TOKENS", "16"))
NUM_KV_BLOCKS = int(os.environ.get("PAGEDLLM_STORM_KV_BLOCKS", "12"))  # 16 tokens each
SEED = int(os.environ.get("PAGEDLLM_STORM_SEED", "0"))
# The server's waiting-queue limit; a storm larger than this gets fast 503s for the excess.
MAX_WAITING = int(os.environ.get("PAGEDLLM_STORM_MAX_WAITING", str(DEFAULT_MAX_WAITING_REQUESTS)))


def prompt_of(i: int) -> str:
    return f"Storm request {i % NUM_PROMPTS}: " + "abc" * (i % 5)


@pytest.fixture(scope="module")
def storm_config(tiny_model_dir, one_torch_thread):
    # Each request needs 2-3 blocks; 12 blocks hold about 5 of the 300 at once.
    return tiny_config(tiny_model_dir, num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=64)


def solo_texts(config, prompts: list[str]) -> dict[str, str]:
    """Each prompt run alone through an engine of the server's settings, in this process."""
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    texts = {}
    for k, prompt in enumerate(prompts):
        engine.add_request(f"solo-{k}", prompt, params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    texts[prompt] = output.outputs[0].text
    return texts


async def stream_one(client: httpx.AsyncClient, prompt: str, hang_up_after: int | None) -> dict:
    """Stream one completion; with hang_up_after, close the connection after that many events
    (0: right after the response starts)."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text, finish_reason, events = [], None, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"status": response.status_code, "body": (await response.aread()).decode(),
                    "retry_after": response.headers.get("retry-after")}
        async for line in response.aiter_lines():
            if hang_up_after is not None and events >= hang_up_after:
                return {"status": "hung up"}
            if not line.startswith("data: "):
                continue
            events += 1
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                return {"status": "error", "body": chunk}
            for choice in chunk["choices"]:
                text.append(choice["text"])
                finish_reason = choice["finish_reason"] or finish_reason
    return {"status": 200, "text": "".join(text), "finish_reason": finish_reason}


async def client_task(client, prompt: str, plan: tuple[str, float]) -> dict:
    kind, amount = plan
    if kind == "stay":
        return await stream_one(client, prompt, None)
    if kind == "events":
        return await stream_one(client, prompt, int(amount))
    try:  # "timer": hang up after a random time, wherever the request is by then
        return await asyncio.wait_for(stream_one(client, prompt, None), timeout=amount)
    except TimeoutError:
        return {"status": "hung up"}


def plans(rng: random.Random) -> list[tuple[str, float]]:
    """A third of the clients hang up: half after a random number of events, half after a
    random time (some before their first token, some mid-stream, some never in time)."""
    result = []
    for i in range(NUM_REQUESTS):
        if i % 3 != 1:
            result.append(("stay", 0))
        elif rng.random() < 0.5:
            result.append(("events", rng.randint(0, MAX_TOKENS)))
        else:
            result.append(("timer", rng.uniform(0.0, 3.0)))
    return result


def test_storm_with_hangups_on_a_tiny_kv_cache(storm_config):
    prompts = [prompt_of(i) for i in range(NUM_REQUESTS)]
    solo = solo_texts(storm_config, sorted(set(prompts)))
    rng = random.Random(SEED)
    order = plans(rng)

    with RunningServer(storm_config, async_engine_kwargs={"max_waiting_requests": MAX_WAITING}) as server:
        async def run():
            limits = httpx.Limits(max_connections=NUM_REQUESTS + 10, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=server.base_url, limits=limits,
                                         timeout=httpx.Timeout(120.0)) as client:
                return await asyncio.gather(*(client_task(client, p, plan)
                                              for p, plan in zip(prompts, order)))

        results = asyncio.run(run())
        snap = server.wait_idle(timeout_s=60)
        metrics = httpx.get(f"{server.base_url}/metrics").text
        healthy = httpx.get(f"{server.base_url}/health").status_code
        after = httpx.post(f"{server.base_url}/v1/completions",
                           json={"prompt": prompts[0], "max_tokens": MAX_TOKENS, "temperature": 0})
        leftover_streams = dict(server.async_engine._streams)
        unfinished = server.async_engine.has_unfinished_requests()

    # Past the queue limit a client is refused at once (503, Retry-After), never queued.
    refused = [r for r in results if r["status"] == 503]
    assert all("overloaded" in r["body"] and r["retry_after"] for r in refused), refused[:3]
    if NUM_REQUESTS <= MAX_WAITING:
        assert not refused
    stayed = [(p, r) for p, r, plan in zip(prompts, results, order) if plan[0] == "stay"
              and r["status"] != 503]
    assert all(r["status"] == 200 for _, r in stayed), [r for _, r in stayed if r["status"] != 200][:3]
    assert len(stayed) >= min(NUM_REQUESTS, MAX_WAITING) // 2
    # Every answer, including those of clients that would have hung up later, is the solo text.
    answered = [(p, r) for p, r in zip(prompts, results) if r["status"] == 200]
    bad = [(p, r) for p, r in answered if r["text"] != solo[p]]
    assert not bad, f"{len(bad)} of {len(answered)} answers differ from the solo text: {bad[:3]}"
    assert all(r["finish_reason"] in ("length", "stop") for _, r in answered)
    hangups = [r for r, plan in zip(results, order) if plan[0] != "stay" and r["status"] != 503]
    assert all(r["status"] in ("hung up", 200) for r in hangups), hangups
    assert sum(r["status"] == "hung up" for r in hangups) >= len(hangups) // 3

    # Preempted and counted, then nothing in use and nothing queued anywhere.
    assert snap.num_preemptions > 0
    counted = float(re.search(r"^pagedllm:num_preemptions_total (\S+)$", metrics, re.M).group(1))
    assert counted == snap.num_preemptions
    assert snap.kv.num_used_blocks == 0 and snap.kv.usage == 0
    assert snap.kv.num_free_blocks == snap.kv.num_blocks
    assert snap.num_running == 0 and snap.num_waiting == 0
    assert not unfinished
    assert not leftover_streams
    assert healthy == 200
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == solo[prompts[0]]


def test_non_streamed_clients_that_time_out_are_aborted(storm_config):
    """A client that gives up on a non-streamed request (a timeout, a closed socket) stops the
    work for it: the server notices the disconnect, aborts the request and frees its blocks."""
    with RunningServer(storm_config) as server:
        tokens_before = server.async_engine.stats.num_generation_tokens
        server.debug("slow_steps", seconds=0.05)  # ~50 ms a step: 30 tokens take seconds

        async def give_up_early():
            async with httpx.AsyncClient(base_url=server.base_url) as client:
                tasks = [client.post("/v1/completions", timeout=0.5, json={
                    "prompt": prompt_of(i), "max_tokens": 30, "ignore_eos": True}) for i in range(4)]
                return await asyncio.gather(*tasks, return_exceptions=True)

        outcomes = asyncio.run(give_up_early())
        assert all(isinstance(o, httpx.TimeoutException) for o in outcomes), outcomes
        snap = server.wait_idle(timeout_s=30)
        server.debug("restore")
        assert snap.num_generation_tokens - tokens_before < 4 * 30
        assert snap.kv.num_used_blocks == 0 and not server.async_engine._streams
        after = httpx.post(f"{server.base_url}/v1/completions",
                           json={"prompt": prompt_of(0), "max_tokens": 4}, timeout=30)
        assert after.status_code == 200
