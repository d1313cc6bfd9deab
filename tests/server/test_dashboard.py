"""The dashboard over HTTP (the browser test is test_dashboard_browser.py): the page is served
self-contained, its events need the API key, show the engine's blocks while a request runs and
all free after, one snapshot serves every watcher, and a dead engine ends the stream with its
reason."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pagedllm.core.kv.snapshot import STATE_NAMES, BlockMap
from pagedllm.server.async_engine import EngineDeadError
from pagedllm.server.dashboard import EVENTS_PATH, _SharedSnapshot, dashboard_router
from tests.server.conftest import API_KEY, RunningServer, metric_value, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def dashboard_server(tiny_model_dir, one_torch_thread):
    config = tiny_config(tiny_model_dir, num_kv_blocks=96, block_size=4)
    with RunningServer(config, api_key=API_KEY) as running:
        yield running


def first_event(base_url: str, headers: dict | None = None) -> dict:
    with httpx.stream("GET", base_url + EVENTS_PATH, headers=headers or AUTH, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                return json.loads(line.removeprefix("data: "))
    raise AssertionError("the stream ended without an event")


def test_the_page_is_served_whole_at_root_and_dashboard(dashboard_server):
    for path in ("/", "/dashboard"):
        response = httpx.get(dashboard_server.base_url + path)  # no key: the page holds no data
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
        page = response.text
        assert "Content-Security-Policy" in page and "default-src 'none'" in page
        # Self-contained: no link to anything, on this server or elsewhere.
        assert not re.search(r"\b(src|href)\s*=", page) and "http:" not in page and "https:" not in page
    schema = httpx.get(dashboard_server.base_url + "/openapi.json").json()
    assert not {"/", "/dashboard", EVENTS_PATH} & set(schema["paths"])  # not an API operation


def test_events_need_the_api_key_like_v1(dashboard_server):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": API_KEY}):
        response = httpx.get(dashboard_server.base_url + EVENTS_PATH, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"


def test_an_idle_engine_shows_every_block_free(dashboard_server):
    dashboard_server.wait_idle()
    event = first_event(dashboard_server.base_url)
    stats, blocks = event["stats"], BlockMap.from_dict(event["blocks"])
    assert stats["num_blocks"] == metric_value(dashboard_server.base_url, "kv_cache_blocks_total") == 96
    assert blocks.num_blocks == 96 and blocks.block_size == 4
    counts = blocks.counts()
    assert counts["free"] + counts["cached"] == 96 and blocks.owners == {}


def test_a_running_request_owns_blocks_and_gives_them_back(dashboard_server):
    base = dashboard_server.base_url
    # 40 steps of 0.1 s: the request still runs when the watcher connects, even on a busy machine.
    dashboard_server.debug("slow_steps", seconds=0.1)
    body = {"prompt": "abcdefghij" * 2, "max_tokens": 40, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", base + "/v1/completions", json=body, headers=AUTH,
                          timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # it is running
            event = first_event(base)
            for _ in lines:  # let it finish
                pass
    finally:
        dashboard_server.debug("restore")
    blocks = BlockMap.from_dict(event["blocks"])
    (request_id, runs), = blocks.owners.items()
    assert request_id.startswith("cmpl-")
    owned = [start + k for start, length in runs for k in range(length)]
    assert all(STATE_NAMES[blocks.states[i]] == "used" and blocks.ref_counts[i] == 1 for i in owned)
    assert sum(blocks.filled[i] for i in owned) == event["stats"]["used_slots"] >= 20
    assert event["stats"]["num_running"] == 1

    dashboard_server.wait_idle()
    after = BlockMap.from_dict(first_event(base)["blocks"])
    assert after.owners == {} and after.counts()["used"] == 0
    assert after.counts()["cached"] >= 5  # the prompt's full blocks stay for reuse


def _app(snapshot_fn, **kwargs) -> TestClient:
    app = FastAPI()
    app.include_router(dashboard_router(snapshot_fn, **kwargs))
    return TestClient(app)


def _events(client: TestClient) -> list[dict]:
    with client.stream("GET", EVENTS_PATH) as response:
        return [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                if line.startswith("data: ")]


def test_a_stream_ends_after_its_lifetime_so_shutdown_never_waits_long():
    calls = []

    async def snapshot():
        calls.append(1)
        return {"n": len(calls)}

    events = _events(_app(snapshot, interval_s=0.02, stream_lifetime_s=0.2))
    assert 3 <= len(events) <= 20 and events[-1] == {"n": len(calls)}


def test_a_dead_engine_ends_the_stream_with_its_reason():
    async def dead():
        raise EngineDeadError("the engine failed 3 steps in a row")

    assert _events(_app(dead)) == [{"error": "the engine is not running: the engine failed 3 "
                                             "steps in a row"}]

    async def broken():
        raise KeyError("internal detail")

    (event,) = _events(_app(broken))
    assert "internal detail" not in event["error"] and "server log" in event["error"]


def test_one_snapshot_serves_every_watcher():
    calls = []

    async def snapshot():
        calls.append(1)
        await asyncio.sleep(0.05)
        return {"n": len(calls)}

    async def watch():
        shared = _SharedSnapshot(snapshot, max_age_s=10)
        return await asyncio.gather(*(shared.get() for _ in range(20)))

    events = asyncio.run(watch())
    assert len(calls) == 1 and len(set(events)) == 1


def test_a_snapshot_is_one_request_and_reply_with_the_core(dashboard_server):
    """The core answers between two steps with its figures and block map (its bytes raw);
    a stopped engine refuses."""
    engine = dashboard_server.async_engine
    stats, blocks = asyncio.run_coroutine_threadsafe(engine.snapshot(), engine._loop).result(30)
    assert isinstance(blocks, BlockMap) and isinstance(blocks.states, bytes)
    assert blocks.num_blocks == stats.kv.num_blocks == 96


def test_a_stopped_engine_refuses_snapshots(tiny_model_dir):
    with RunningServer(tiny_config(tiny_model_dir, num_kv_blocks=16)) as server:
        engine = server.async_engine
    with pytest.raises(EngineDeadError):
        asyncio.run(engine.snapshot())


def test_event_readers_past_the_limit_get_a_503_and_a_slot_frees_when_one_leaves():
    """Issue 32, finding 7: 150 readers stretched other clients' streams; past max_readers a
    reader gets a 503 with Retry-After, and a reader that leaves gives its place back."""
    async def snapshot():
        return {"n": 1}

    client = _app(snapshot, interval_s=0.01, stream_lifetime_s=30, max_readers=2)
    with client.stream("GET", EVENTS_PATH) as first, client.stream("GET", EVENTS_PATH) as second:
        assert first.status_code == second.status_code == 200
        third = client.get(EVENTS_PATH)
        assert third.status_code == 503 and third.headers["Retry-After"] == "5"
        assert "2 event readers" in third.json()["error"]["message"]
    with client.stream("GET", EVENTS_PATH) as again:
        assert again.status_code == 200
