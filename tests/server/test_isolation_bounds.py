"""Validated means runnable (issue 32, finding 1): the extremes of every sampling field, and the
seeded garbage fuzz, sent through `pagedllm serve` with its real core while another client
streams. Each request is answered 200 or refused 400 naming the field (never a 5xx: a value the
core cannot run used to fail every request in its step), and the other client's text equals its
solo text every time (the server runs batch-invariant, so its text cannot depend on who shares
its steps)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.sampling_bounds import LIST_BOUNDS, NUMBER_BOUNDS
from tests.conftest import wait_for
from tests.server.conftest import RunningServer, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WATCH_BODY = {"prompt": "hello there", "max_tokens": 24, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def bounds_server(tiny_model_dir, one_torch_thread):
    config = tiny_config(tiny_model_dir, num_kv_blocks=1024, max_num_seqs=256, batch_invariant=True)
    with RunningServer(config) as running:
        yield running


class TextWatch:
    """Another client: greedy streams one after another in a thread, each one's text kept."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.texts: list[str] = []
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {**WATCH_BODY, "stream": True}
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                parts = []
                with client.stream("POST", f"{self.base_url}/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        self.failures.append(f"{response.status_code}: {response.read()[:300]!r}")
                        continue
                    for line in response.iter_lines():
                        if line.startswith("data:") and line != "data: [DONE]":
                            event = json.loads(line[5:])
                            if "error" in event:
                                self.failures.append(str(event["error"]))
                            else:
                                parts.extend(c["text"] for c in event["choices"])
                self.texts.append("".join(parts))

    def __enter__(self) -> TextWatch:
        self.thread.start()
        wait_for(lambda: self.texts or not self.thread.is_alive(), "the watching client's first text")
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=60)

    def assert_unharmed(self, solo: str) -> None:
        assert not self.failures, self.failures[:3]
        assert len(self.texts) >= 2
        assert all(text == solo for text in self.texts), [t for t in self.texts if t != solo][:2]


def solo_text(base_url: str) -> str:
    response = httpx.post(f"{base_url}/v1/completions", json=WATCH_BODY, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


# -- extremes of every field ---------------------------------------------------------------------
BIG_INTS = [-(2**70), -(2**63) - 1, -(2**63), -(2**31) - 1, -(2**31), -2, -1, 0, 1, 2, 20, 21, 64, 65,
            2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**70, int("9" * 400)]
BIG_FLOATS = [-1.7976931348623157e308, -100.5, -2.0000001, -1e-300, -5e-324, 0.0, 5e-324, 1e-300,
              1e-9, 0.9999999999, 1.0, 1.0000001, 2.0, 100.0, 100.5, 1.7976931348623157e308]


def _vocab_ids(count: int, start: int = 0) -> list[int]:
    return [start + i % 200 for i in range(count)]


# Fields as the bodies spell them -> values to try (numbers get both kinds of extremes).
def _number_field_values(name: str) -> list:
    return BIG_INTS + BIG_FLOATS if NUMBER_BOUNDS[name].kind == "float" else BIG_INTS + [1.0, 2.5]


LIST_VALUES = {
    "stop": [["x"] * LIST_BOUNDS["stop"], ["x"] * (LIST_BOUNDS["stop"] + 1), ["y" * 256], ["y" * 257]],
    "stop_token_ids": [_vocab_ids(LIST_BOUNDS["stop_token_ids"]),
                       _vocab_ids(LIST_BOUNDS["stop_token_ids"] + 1), [2**63], [2**31], [10**6], [-1]],
    "bad_words": [["zz"] * LIST_BOUNDS["bad_words"], ["zz"] * (LIST_BOUNDS["bad_words"] + 1), ["q" * 256]],
    "logit_bias": [{str(i): 100 for i in range(LIST_BOUNDS["logit_bias"])},
                   {str(i): -100 for i in range(LIST_BOUNDS["logit_bias"] + 1)},
                   {str(2**63): 1}, {str(-1): 1}, {"5": 1e308}, {"5": -100.0}, {"9" * 5000: 1}],
    "allowed_token_ids": [_vocab_ids(5000), [2**63], [2**31 - 1], [0]],
}
SHARED_NUMBER_FIELDS = ["n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                        "frequency_penalty", "repetition_penalty", "seed", "min_tokens", "prompt_logprobs"]
ENDPOINT_FIELDS = {
    "/v1/completions": {**{f: _number_field_values(f) for f in SHARED_NUMBER_FIELDS},
                        "max_tokens": _number_field_values("max_tokens"),
                        "logprobs": _number_field_values("logprobs"), **LIST_VALUES},
    "/v1/chat/completions": {**{f: _number_field_values(f) for f in SHARED_NUMBER_FIELDS},
                             "max_tokens": _number_field_values("max_tokens"),
                             "max_completion_tokens": _number_field_values("max_tokens"),
                             "top_logprobs": _number_field_values("logprobs"), **LIST_VALUES},
}
CASES = [(path, field, value) for path, fields in ENDPOINT_FIELDS.items()
         for field, values in fields.items() for value in values]


def body_for(path: str, field: str, value, stream: bool) -> dict:
    body: dict = {"max_tokens": 3, field: value, "stream": stream}
    if path == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
        if field == "top_logprobs":
            body["logprobs"] = True
    if field == "prompt_logprobs" and stream:
        body["stream"] = False  # not available when streaming (a 400 of its own)
    return body


def check_answer(response: httpx.Response, field: str, body: dict) -> None:
    assert response.status_code < 500, (field, body.get(field), response.text[:500])
    if response.status_code == 400:
        error = response.json()["error"]
        # a chat's max_completion_tokens is its max_tokens, and errors name it so (test_limits)
        names = {field, "max_tokens"} if field == "max_completion_tokens" else {field}
        named = error["param"] in names or any(name in error["message"] for name in names)
        assert named, (field, error)
    else:
        assert response.status_code == 200, (field, response.status_code, response.text[:300])


def test_the_extremes_of_every_field_are_answered_or_refused_by_name(bounds_server):
    base_url = bounds_server.base_url
    solo = solo_text(base_url)

    @given(case=st.sampled_from(CASES), stream=st.booleans())
    @settings(max_examples=len(CASES) * 2, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def one_case(case, stream):
        path, field, value = case
        body = body_for(path, field, value, stream)
        response = client.post(f"{base_url}{path}", content=json.dumps(body).encode(),
                               headers={"Content-Type": "application/json"})
        check_answer(response, field, body)

    with TextWatch(base_url) as watch, httpx.Client(timeout=120) as client:
        one_case()
        # and every case once, in order (hypothesis may draw some twice, others not at all)
        for path, field, value in CASES:
            body = body_for(path, field, value, stream=False)
            check_answer(client.post(f"{base_url}{path}", json=body), field, body)
    watch.assert_unharmed(solo)


def test_top_k_past_int64_runs_as_every_token(bounds_server):
    """The value that failed every request in its step (issue 32, finding 1): top_k beyond what
    the sampler's int64 tensor holds. Any top_k at or above the vocabulary means every token, so
    it runs, and gives the same greedy text as no top_k."""
    base_url = bounds_server.base_url
    plain = httpx.post(f"{base_url}/v1/completions", json=WATCH_BODY, timeout=60)
    for top_k in (2**70, 2**63, 2**31 - 1):
        response = httpx.post(f"{base_url}/v1/completions", json={**WATCH_BODY, "top_k": top_k}, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


def test_the_seeded_garbage_fuzz_leaves_another_client_unharmed(bounds_server):
    """Finding 1's probe: 250 seeded garbage bodies (test_fuzz's, past the schema) to both
    endpoints while another client streams: no 5xx, and its text equals its solo text."""
    fuzz = pytest.importorskip("tests.server.test_fuzz")
    base_url = bounds_server.base_url
    solo = solo_text(base_url)

    @given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
           body=st.one_of(fuzz.bodies.map(fuzz.raw_body), st.binary(max_size=64)))
    @settings(max_examples=250, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def one_body(path, body):
        response = client.post(f"{base_url}{path}", content=body,
                               headers={"Content-Type": "application/json"})
        assert response.status_code < 500, (body, response.text[:500])

    with TextWatch(base_url) as watch, httpx.Client(timeout=120) as client:
        one_body()
    watch.assert_unharmed(solo)
