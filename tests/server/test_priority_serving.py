"""Priority scheduling through `pagedllm serve` (issue 37): with --scheduling-policy priority, a
priority-0 request sent while 32 priority-10 requests run in a tight KV cache is answered before any
of them ends, and each of them still ends with the text it has alone; under fcfs a priority is a
400 naming the field and the flag. Behaviour, not time: the steps are slowed so that the order does
not depend on how busy the machine is."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.conftest import wait_for
from tests.server.conftest import RunningServer, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def prompt(i: int) -> list[int]:
    return [(7 * i + k) % 200 + 3 for k in range(8)]


def complete(base_url: str, token_ids: list[int], max_tokens: int, **fields) -> httpx.Response:
    body = {"prompt": token_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **fields}
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=300)


@pytest.fixture(scope="module")
def priority_server(tiny_model_dir, one_torch_thread):
    # 96 blocks of 16: exactly the 32 requests' 3 blocks each (8 + 40 tokens), none to spare.
    config = tiny_config(tiny_model_dir, num_kv_blocks=96, max_num_seqs=64,
                         scheduling_policy="priority", enable_prefix_caching=False)
    with RunningServer(config) as running:
        yield running


def test_a_priority_0_request_is_answered_before_32_running_priority_10_end(priority_server, tmp_path):
    base, engine = priority_server.base_url, priority_server.async_engine
    ended: list[str] = []  # in the order the answers came
    texts: dict[int, str] = {}

    def low(i: int) -> None:
        response = complete(base, prompt(i), 40, priority=10)
        assert response.status_code == 200, response.text
        texts[i] = response.json()["choices"][0]["text"]
        ended.append(f"low{i}")

    # The first step is held until all 32 have reached the core, so they run in lockstep; then
    # steps of at least 0.15 s: the cache is full from the 26th step to the 40th, their last. The
    # high request arrives in that window, and without preempting would wait for a low one to end.
    stalled, release = tmp_path / "stalled", tmp_path / "release"
    priority_server.debug("stall_steps", stalled_path=str(stalled), release_path=str(release))
    try:
        threads = [threading.Thread(target=low, args=(i,), daemon=True) for i in range(32)]
        for thread in threads:
            thread.start()
        wait_for(lambda: stalled.exists() and engine.output_processor.num_unfinished_requests == 32,
                 "32 requests sent to the core", timeout_s=120)
        release.touch()
        priority_server.debug("slow_steps", seconds=0.15)  # within a step or two of the held one
        wait_for(lambda: (engine.stats.num_running == 32 and engine.stats.kv.num_free_blocks == 0) or ended,
                 "32 requests running in a full cache", timeout_s=120)
        high = complete(base, prompt(100), 4, priority=0)
        ended.append("high")
        assert high.status_code == 200, high.text
        for thread in threads:
            thread.join(timeout=300)
    finally:
        priority_server.debug("restore")
    assert ended[0] == "high", ended[:3]
    assert len(texts) == 32 and engine.stats.num_preemptions > 0  # only the high request preempts
    solo = {i: complete(base, prompt(i), 40).json()["choices"][0]["text"] for i in range(32)}
    assert texts == solo
    assert high.json()["choices"][0]["text"] == complete(base, prompt(100), 4).json()["choices"][0]["text"]


def test_a_priority_out_of_range_is_a_400_naming_it(priority_server):
    for bad in (2**63, "high", 1.5):
        response = complete(priority_server.base_url, prompt(0), 2, priority=bad)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "priority"


def test_under_fcfs_a_priority_is_a_400_naming_the_field_and_the_flag(tiny_model_dir):
    with RunningServer(tiny_config(tiny_model_dir)) as fcfs:
        for path, body in [("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]:
            response = httpx.post(f"{fcfs.base_url}{path}", json={**body, "max_tokens": 2, "priority": 1},
                                  timeout=60)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]
            zero = httpx.post(f"{fcfs.base_url}{path}", json={**body, "max_tokens": 2, "priority": 0},
                              timeout=60)
            assert zero.status_code == 200, zero.text
