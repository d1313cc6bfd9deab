"""vLLM's extras by vLLM's names and shapes, on the tiny model: return_token_ids, -1 for the whole
vocabulary (held to the logprobs cap), /tokenizer_info, /load and the ORCA load header, metrics
under `vllm:` names, /v1/chat/completions/batch, and the server flags --return-tokens-as-token-ids,
--enable-force-include-usage, --root-path and --uds (the last through `pagedllm serve` itself)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from pagedllm.sampling_bounds import MAX_LOGPROBS
from pagedllm.server.answer_options import AnswerOptions
from pagedllm.server.load import LoadTracker, ServerLoad
from pagedllm.server.logprob_counts import resolve_count
from pagedllm.server.protocol import APIError
from tests.server.conftest import API_KEY, MODEL_NAME, RunningServer, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """The flags on: logprobs by token id, usage on every stream with the cached prompt tokens,
    /tokenizer_info, a root path."""
    with RunningServer(tiny_config(tiny_model_dir), api_key=API_KEY,
                       options=AnswerOptions(return_tokens_as_token_ids=True, force_include_usage=True,
                                             prompt_tokens_details=True),
                       root_path="/llm", enable_tokenizer_info_endpoint=True) as running:
        yield running


def post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json={"model": MODEL_NAME, **body},
                      headers={**AUTH, **kwargs.pop("headers", {})}, timeout=120, **kwargs)


def ok(server, path: str, body: dict) -> dict:
    response = post(server, path, body)
    assert response.status_code == 200, response.text
    return response.json()


def events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}{path}", json={"model": MODEL_NAME, "stream": True, **body},
                      headers=AUTH, timeout=120) as response:
        assert response.status_code == 200, response.read()
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# -- return_token_ids ------------------------------------------------------------------------------

def test_return_token_ids_in_completions_whole_and_streamed(server):
    tokenizer = server.async_engine.input_processor.tokenizer
    body = {"prompt": "The cat", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    choice = ok(server, "/v1/completions", {**body, "return_token_ids": True})["choices"][0]
    assert choice["prompt_token_ids"] == tokenizer.encode("The cat")
    assert len(choice["token_ids"]) == 5 and tokenizer.decode(choice["token_ids"]) == choice["text"]
    # --return-tokens-as-token-ids: the logprobs name the same ids
    assert [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]] == choice["token_ids"]
    plain = ok(server, "/v1/completions", body)["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None  # vLLM's: null, not absent

    streamed = events(server, "/v1/completions", {**body, "return_token_ids": True})
    chunks = [c for c in streamed if c["choices"]]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]


def test_return_token_ids_in_chat_whole_and_streamed(server):
    body = {"messages": CHAT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    plain = ok(server, "/v1/chat/completions", {**body, "return_token_ids": False})
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None
    whole = ok(server, "/v1/chat/completions", body)
    prompt_ids = ok(server, "/tokenize", {"messages": CHAT})["tokens"]
    assert whole["prompt_token_ids"] == prompt_ids and len(whole["choices"][0]["token_ids"]) == 5
    chunks = events(server, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] \
        == whole["choices"][0]["token_ids"]


# -- -1: the whole vocabulary ----------------------------------------------------------------------

@pytest.mark.parametrize(("path", "field", "body"), [
    ("/v1/completions", "logprobs", {"prompt": "hi", "logprobs": -1}),
    ("/v1/completions", "prompt_logprobs", {"prompt": "hi", "prompt_logprobs": -1}),
    ("/v1/chat/completions", "top_logprobs", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}),
    ("/v1/chat/completions", "prompt_logprobs", {"messages": CHAT, "prompt_logprobs": -1}),
])
def test_minus_one_is_the_whole_vocabulary_held_to_the_cap(server, path, field, body):
    response = post(server, path, {**body, "max_tokens": 1})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and "300 tokens" in error["message"]
    assert f"at most {MAX_LOGPROBS}" in error["message"]
    assert post(server, path, {**body, field: -2, "max_tokens": 1}).status_code == 400


def test_minus_one_resolves_to_a_vocabulary_within_the_cap():
    assert resolve_count("logprobs", -1, MAX_LOGPROBS, MAX_LOGPROBS) == MAX_LOGPROBS
    assert resolve_count("logprobs", 3, 50_000, MAX_LOGPROBS) == 3
    assert resolve_count("logprobs", None, 5, MAX_LOGPROBS) is None
    with pytest.raises(APIError, match="49152 tokens.*at most 20 .*--max-logprobs"):
        resolve_count("top_logprobs", -1, 49152, MAX_LOGPROBS)
    # --max-logprobs -1: the whole vocabulary; N: N, never past the vocabulary (topk takes no more)
    assert resolve_count("top_logprobs", -1, 49152, -1) == 49152
    assert resolve_count("logprobs", 100, 300, 1000) == 100
    with pytest.raises(APIError, match=r"logprobs=301 .* at most 300 \(the model's vocabulary"):
        resolve_count("logprobs", 301, 300, 1000)
    with pytest.raises(APIError, match="prompt_logprobs=6 .* at most 5 .*--max-logprobs"):
        resolve_count("prompt_logprobs", 6, 300, 5)


# -- logprob_token_ids -----------------------------------------------------------------------------

def test_logprob_token_ids_list_those_tokens_whole_and_streamed(server):
    """vLLM's logprob_token_ids: each token's alternatives are the chosen token and the given ones,
    valued as an unconstrained request's top list values them (raw logits: before
    allowed_token_ids' mask), whatever logprobs/top_logprobs ask; without logprobs, a 400."""
    common = {"max_tokens": 1, "temperature": 0}
    top = ok(server, "/v1/completions", {"prompt": "The cat", "logprobs": 20, **common})
    listed = top["choices"][0]["logprobs"]["top_logprobs"][0]
    ranked = [(int(token.removeprefix("token_id:")), value) for token, value in listed.items()]
    (first, first_value), (fifth, fifth_value) = ranked[1], ranked[5]  # after the chosen token
    chosen = ranked[-1][0]  # forced by allowed_token_ids: not one of the pinned tokens
    pinned = {"logprob_token_ids": [first, fifth], "allowed_token_ids": [chosen], **common}
    expected = {f"token_id:{first}": first_value, f"token_id:{fifth}": fifth_value}

    def check(listed: dict) -> None:
        assert set(listed) == {*expected, f"token_id:{chosen}"}
        assert all(listed[token] == pytest.approx(value, abs=1e-4) for token, value in expected.items())

    check(ok(server, "/v1/completions", {"prompt": "The cat", "logprobs": 1, **pinned})
          ["choices"][0]["logprobs"]["top_logprobs"][0])
    streamed = events(server, "/v1/completions", {"prompt": "The cat", "logprobs": 0, **pinned})
    [streamed] = [chunk for chunk in streamed if chunk["choices"]]
    check(streamed["choices"][0]["logprobs"]["top_logprobs"][0])
    chat = ok(server, "/v1/chat/completions",
              {"messages": CHAT, "logprobs": True, "top_logprobs": 5, **pinned})
    listed = chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert {entry["token"] for entry in listed} == {*expected, f"token_id:{chosen}"}
    response = post(server, "/v1/chat/completions", {"messages": CHAT, **pinned})
    assert response.status_code == 400 and response.json()["error"]["param"] == "logprob_token_ids"


# -- server flags ----------------------------------------------------------------------------------

def test_force_include_usage_puts_running_usage_on_every_chunk(server):
    chunks = events(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "ignore_eos": True})
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 4 and chunks[-1]["choices"] == []


def test_root_path_serves_both_paths_behind_the_api_key(server):
    for prefix in ("", "/llm"):
        assert post(server, f"{prefix}/v1/completions", {"prompt": "hi", "max_tokens": 1}).status_code == 200
        for path in ("/v1/completions", "/tokenize", "/tokenizer_info", "/invocations"):
            refused = httpx.post(f"{server.base_url}{prefix}{path}", json={"prompt": "hi"}, timeout=60)
            assert refused.status_code == 401, (prefix, path)
    assert httpx.get(f"{server.base_url}/openapi.json").json()["servers"] == [{"url": "/llm"}]


def test_tokenizer_info(server):
    info = httpx.get(f"{server.base_url}/tokenizer_info", headers=AUTH).json()
    tokenizer = server.async_engine.input_processor.tokenizer
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert info["bos_token"] == "<|bos|>" and info["eos_token"] == "<|eos|>"
    assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] == 64
    assert info["added_tokens_decoder"]["256"] == {"content": "<|bos|>", "special": True}


def test_tokenizer_info_is_off_unless_asked(tiny_model_dir):
    with RunningServer(tiny_config(tiny_model_dir), with_hooks=False) as plain:
        assert httpx.get(f"{plain.base_url}/tokenizer_info").status_code == 404


# -- load ------------------------------------------------------------------------------------------

def test_load_counts_the_requests_being_answered(server):
    def load() -> int:
        return httpx.get(f"{server.base_url}/load").json()["server_load"]

    assert load() == 0
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert httpx.post(f"{server.base_url}/v1/completions", json={}).status_code == 401  # refused: no load
    assert load() == 0


def test_load_tracker_counts_a_request_until_its_answer_ends():
    """The middleware alone, around an app whose answer waits: no timing in the assertions."""
    load = ServerLoad()
    release = asyncio.Event()
    seen = []

    async def slow_app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        seen.append(load.in_flight)
        await release.wait()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    tracker = LoadTracker(slow_app, load, lambda: None)  # no ORCA header asked: never read

    async def run():
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "root_path": "", "headers": []}
        sent = []

        async def send(message):
            sent.append(message)

        task = asyncio.ensure_future(tracker(scope, None, send))
        while not seen:
            await asyncio.sleep(0)
        during = load.in_flight
        release.set()
        await task
        other = {**scope, "path": "/health", "method": "GET"}
        await LoadTracker(lambda *a: asyncio.sleep(0), load, lambda: None)(other, None, send)
        return during, load.in_flight

    assert asyncio.run(run()) == (1, 0) and seen == [1]


def test_orca_load_header_when_asked(server):
    body = {"prompt": "hi", "max_tokens": 1}
    assert "endpoint-load-metrics" not in post(server, "/v1/completions", body).headers
    text = post(server, "/v1/completions", body, headers={"endpoint-load-metrics-format": "text"})
    assert re.fullmatch(r"TEXT named_metrics\.kv_cache_usage_perc=[0-9.e-]+, "
                        r"named_metrics\.num_requests_waiting=[0-9.]+", text.headers["endpoint-load-metrics"])
    as_json = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1},
                   headers={"endpoint-load-metrics-format": "JSON"}).headers["endpoint-load-metrics"]
    assert set(json.loads(as_json.removeprefix("JSON "))["named_metrics"]) == {
        "kv_cache_usage_perc", "num_requests_waiting"}


def test_metrics_also_under_vllm_names(server):
    text = httpx.get(f"{server.base_url}/metrics").text
    ours = dict(re.findall(r"^pagedllm:(\S+) (\S+)$", text, re.M))
    theirs = dict(re.findall(r"^vllm:(\S+) (\S+)$", text, re.M))
    assert {"num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
            "time_to_first_token_seconds_count"} <= set(theirs)
    assert set(ours) == set(theirs)
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text


def samples(server) -> dict[tuple[str, tuple], float]:
    """/metrics' vllm: samples by (name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.base_url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) if family.name.startswith("vllm:")
            for s in family.samples}


# The families vLLM 0.32's own metrics test expects of a text model.
VLLM_FAMILIES = {"num_requests_running", "num_requests_waiting", "num_requests_waiting_by_reason",
                 "kv_cache_usage_perc", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
                 "admission_rejections", "prompt_tokens", "generation_tokens", "iteration_tokens_total",
                 "cache_config_info", "request_success", "request_prompt_tokens",
                 "request_generation_tokens", "request_params_n", "request_params_max_tokens",
                 "time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_inference_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_num_preemptions"}


def test_vllms_metric_families_count_what_they_name(server):
    """Each family vLLM's test expects is there, and the per-request ones count K requests of P
    prompt tokens and M generated ones: the tokens the model computed (the prompt less its cached
    tokens, then M - 1 decodes) over 1 + S steps each, S the decode steps (one per decode burst of
    B tokens: pagedllm.engine.decode_burst), and S inter-token intervals (as vLLM, one per step
    that gives a request tokens)."""
    from prometheus_client.parser import text_string_to_metric_families

    from pagedllm.config import EngineConfig

    text = httpx.get(f"{server.base_url}/metrics").text
    names = {family.name.removeprefix("vllm:") for family in text_string_to_metric_families(text)}
    assert VLLM_FAMILIES <= names
    before = samples(server)
    k, m, prompt = 3, 5, [5, 6, 7, 8]
    answers = [ok(server, "/v1/completions", {"prompt": prompt, "max_tokens": m, "ignore_eos": True,
                                              "temperature": 0}) for _ in range(k)]
    cached = sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)
    after = samples(server)

    def grew(name: str, **labels) -> float:
        key = (f"vllm:{name}", tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert grew("request_prompt_tokens_sum") == k * len(prompt) and grew("request_prompt_tokens_count") == k
    assert grew("request_generation_tokens_sum") == k * m
    assert grew("request_params_max_tokens_sum") == k * m and grew("request_params_n_sum") == k
    decode_steps = -(-(m - 1) // EngineConfig().decode_burst)  # the server runs the default
    assert grew("inter_token_latency_seconds_count") == k * decode_steps
    assert grew("iteration_tokens_total_sum") == k * (len(prompt) + m - 1) - cached
    assert grew("iteration_tokens_total_count") == k * (1 + decode_steps)
    assert grew("request_success_total", finished_reason="length") == k
    for name in ("request_queue_time_seconds", "request_inference_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_num_preemptions"):
        assert grew(f"{name}_count") == k, name
    assert after[("vllm:admission_rejections_total", (("reason", "max_num_queued_reqs"),))] == 0
    assert after[("vllm:num_requests_waiting_by_reason", (("reason", "capacity"),))] == 0
    [config] = [dict(labels) for name, labels in after if name == "vllm:cache_config_info"]
    assert config["enable_prefix_caching"] == "True" and int(config["block_size"]) > 0
    slots = int(config["block_size"]) * int(config["num_gpu_blocks"])
    assert int(config["kv_cache_size_tokens"]) == slots
    started = re.search(r"(\d+) token slots.* fits (\d+) requests at once", server.ready.description)
    assert (int(started.group(1)), started.group(2)) == (slots, config["kv_cache_max_concurrency"])


# -- batch -----------------------------------------------------------------------------------------

def test_chat_completions_batch_answers_each_conversation_as_alone(server):
    conversations = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "The cat"}]]
    common = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    batch = ok(server, "/v1/chat/completions/batch", {"messages": conversations, **common})
    alone = [ok(server, "/v1/chat/completions", {"messages": c, **common}) for c in conversations]
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    for choice, single in zip(batch["choices"], alone):
        assert choice["message"] == single["choices"][0]["message"]
        assert choice["prompt_token_ids"] == single["prompt_token_ids"]
    assert batch["usage"]["completion_tokens"] == 12
    streamed = post(server, "/v1/chat/completions/batch", {"messages": conversations, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"
    empty = post(server, "/v1/chat/completions/batch", {"messages": []})
    assert empty.status_code == 400


# -- pagedllm serve --uds --------------------------------------------------------------------------

def test_serve_on_a_unix_socket_with_the_flags(tiny_model_dir, tmp_path):
    socket_path = tmp_path / "api.sock"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    command = [sys.executable, "-m", "pagedllm.cli", "--log-level", "WARNING", "serve", str(tiny_model_dir),
               "--uds", str(socket_path), "--dtype", "float32", "--kv-cache-memory", "8MiB",
               "--served-model-name", "tiny", "--root-path", "/llm", "--return-tokens-as-token-ids",
               "--enable-force-include-usage", "--enable-tokenizer-info-endpoint", "--num-threads", "1"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stderr: list[bytes] = []
    threading.Thread(target=lambda: stderr.append(process.stderr.read()), daemon=True).start()
    try:
        # the host named is the socket's file, as vLLM's test client names it: any host is answered
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(socket_path)), base_url="http://api.sock",
                          timeout=60) as client:
            deadline = time.monotonic() + 120
            while True:
                assert process.poll() is None, stderr
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "no answer on the socket"
                time.sleep(0.2)
            out = client.post("/llm/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                                           "logprobs": 0})
            assert out.status_code == 200, out.text
            assert out.json()["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")
            assert client.get("/tokenizer_info").json()["tokenizer_class"]
            chunks = [line for line in client.post(
                "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True}
            ).text.splitlines() if line.startswith("data: {")]
            assert all('"usage"' in line for line in chunks)
    finally:
        process.terminate()
        process.wait(timeout=60)
