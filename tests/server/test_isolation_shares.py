"""Bounded work per request and fair shares through `pagedllm serve` (issue 32, findings 4, 5, 7):
a request of more sequences than one may ask for, or of prompt logprobs past their budget, is
refused with a 400 naming the field; a request of many sequences holding the engine does not keep
another client's tiny request waiting until it ends (the scheduler admits least-served first,
and the token share set here shows in /metrics);
a logit_bias past its bound is refused before the event loop parses it. Behaviour, not time:
the bench (`pagedllm bench isolation`) measures the gaps."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from pagedllm.sampling_bounds import LIST_BOUNDS
from pagedllm.server.limits import RequestPrecheck
from pagedllm.server.protocol import MAX_PROMPT_LOGPROB_ENTRIES, MAX_SEQUENCES_PER_REQUEST
from tests.conftest import wait_for
from tests.server.conftest import RunningServer, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def shares_server(tiny_model_dir, one_torch_thread):
    # 24 blocks of 16 tokens: a few of the large request's 64-token sequences at a time.
    config = tiny_config(tiny_model_dir, num_kv_blocks=24, max_num_seqs=8, step_share_tokens=4)
    with RunningServer(config) as running:
        yield running


def test_the_token_share_is_in_the_metrics(shares_server):
    metrics = httpx.get(f"{shares_server.base_url}/metrics", timeout=30).text
    assert "pagedllm:step_share_tokens 4.0" in metrics.splitlines()


def test_more_sequences_than_one_request_may_ask_for_is_a_400_naming_n(shares_server):
    prompts = ["hi"] * 64
    n = MAX_SEQUENCES_PER_REQUEST // 64 + 1
    response = httpx.post(f"{shares_server.base_url}/v1/completions",
                          json={"prompt": prompts, "n": n, "max_tokens": 1}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "n" and f"at most {MAX_SEQUENCES_PER_REQUEST}" in error["message"]
    at_the_cap = httpx.post(f"{shares_server.base_url}/v1/completions",
                            json={"prompt": ["hi"] * 8, "n": MAX_SEQUENCES_PER_REQUEST // 8,
                                  "max_tokens": 1}, timeout=120)
    assert at_the_cap.status_code == 200, at_the_cap.text
    assert len(at_the_cap.json()["choices"]) == MAX_SEQUENCES_PER_REQUEST


def test_prompt_logprobs_past_their_budget_are_a_400_and_within_it_are_served(shares_server):
    prompt = list(range(1, 61))  # 60 token ids
    many = len(prompt) * 21 * 64
    assert many > MAX_PROMPT_LOGPROB_ENTRIES
    response = httpx.post(f"{shares_server.base_url}/v1/completions",
                          json={"prompt": [prompt] * 64, "prompt_logprobs": 20, "max_tokens": 1},
                          timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt_logprobs"
    served = httpx.post(f"{shares_server.base_url}/v1/completions",
                        json={"prompt": [prompt] * 2, "prompt_logprobs": 20, "max_tokens": 1}, timeout=60)
    assert served.status_code == 200, served.text
    assert len(served.json()["choices"][0]["prompt_logprobs"]) == len(prompt)


def test_a_tiny_request_is_answered_while_a_large_request_holds_the_engine(shares_server):
    """Finding 4: one request of 256 sequences (64 prompts x n=4, streamed) holds the engine;
    another client's one-token request is answered before most of them have finished. First
    come first served made it wait until the last of the 64 prompts was admitted, by which time
    most of the 256 had run to the end."""
    base_url = shares_server.base_url
    finished = []  # the large request's sequences that have finished, as they stream
    big_status: list[int] = []

    def big() -> None:
        body = {"prompt": ["story"] * 64, "n": 4, "max_tokens": 50, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=600) as response:
            big_status.append(response.status_code)
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    finished.extend(c for c in json.loads(line[6:])["choices"] if c["finish_reason"])

    thread = threading.Thread(target=big, daemon=True)
    thread.start()
    wait_for(lambda: shares_server.async_engine.stats.num_waiting >= 30 or not thread.is_alive(),
             "the large request queued", timeout_s=120)
    tiny = httpx.post(f"{base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=600)
    finished_before_tiny = len(finished)
    assert tiny.status_code == 200, tiny.text
    thread.join(timeout=600)
    assert big_status == [200] and len(finished) == 256
    assert finished_before_tiny < 64, f"{finished_before_tiny} of 256 finished before the tiny one"


def test_a_logit_bias_past_its_bound_is_refused_before_the_schema(shares_server, monkeypatch):
    """Finding 7: a 0.6 MB logit_bias body is refused by the precheck in a worker thread, never
    parsed into the schema on the event loop."""
    refused = []
    real_check = RequestPrecheck._check

    def check(self, body: bytes):
        error = real_check(self, body)
        if error is not None:
            refused.append(error.param)
        return error

    monkeypatch.setattr(RequestPrecheck, "_check", check)
    body = json.dumps({"prompt": "hi", "max_tokens": 1,
                       "logit_bias": {str(i): 1.0 for i in range(40_000)}}).encode()
    assert len(body) > 500_000
    response = httpx.post(f"{shares_server.base_url}/v1/completions", content=body,
                          headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "logit_bias" and str(LIST_BOUNDS["logit_bias"]) in error["message"]
    assert refused == ["logit_bias"]
