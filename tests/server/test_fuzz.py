"""Fuzzing the live server from its own /openapi.json with schemathesis: every endpoint, valid
and invalid bodies. No 5xx, no hang, every error in OpenAI's shape, and the server healthy with
every block free afterwards.

CI runs PAGEDLLM_FUZZ_EXAMPLES (default 60) cases per endpoint with a fixed seed, a few
hundred in all; `make fuzz` sets it to thousands, randomly seeded.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server.conftest import MODEL_NAME, RunningServer, tiny_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXAMPLES = int(os.environ.get("PAGEDLLM_FUZZ_EXAMPLES", "60"))
FIXED_SEED = "PAGEDLLM_FUZZ_EXAMPLES" not in os.environ  # CI: the same cases every run
REQUEST_TIMEOUT_S = 60  # "no hang": any answer slower than this fails the case
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection]
# Every operation in /openapi.json (test_every_endpoint_is_fuzzed keeps this list honest).
ENDPOINTS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
             ("GET", "/health"), ("GET", "/version"), ("GET", "/metrics"), ("POST", "/tokenize"),
             ("POST", "/detokenize"), ("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"),
             ("POST", "/v1/messages"), ("POST", "/v1/embeddings"), ("POST", "/v1/rerank"),
             ("POST", "/v2/rerank"), ("POST", "/rerank"), ("POST", "/v1/score"), ("POST", "/score"),
             ("POST", "/pooling"), ("POST", "/v1/chat/completions/batch"), ("GET", "/load")]
WITH_BODY = {path for method, path in ENDPOINTS if method == "POST"}
# A key every 200 answer of a POST endpoint holds (non-streamed).
ANSWER_KEY = {"/v1/completions": "choices", "/v1/chat/completions": "choices", "/tokenize": "max_model_len",
              "/detokenize": "prompt", "/v1/responses": "output", "/v1/messages": "content",
              "/v1/embeddings": "data", "/v1/rerank": "results", "/v2/rerank": "results",
              "/rerank": "results", "/v1/score": "data", "/score": "data", "/pooling": "data",
              "/v1/chat/completions/batch": "choices"}


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir, one_torch_thread):
    # Room for a fuzzed request with many prompts and large n without endless preemption.
    config = tiny_config(tiny_model_dir, num_kv_blocks=1024, max_num_seqs=256)
    with RunningServer(config) as running:
        yield running


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json")


def test_every_endpoint_is_fuzzed(api_schema):
    operations = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert operations == set(ENDPOINTS)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("method,path", ENDPOINTS)
def test_fuzz(api_schema, fuzz_server, method, path, mode):
    if mode is GenerationMode.NEGATIVE and path not in WITH_BODY:
        pytest.skip("nothing to make invalid: no body, no parameters")
    operation = api_schema[path][method]
    examples = EXAMPLES if path in WITH_BODY else max(5, EXAMPLES // 10)

    @given(case=operation.as_strategy(generation_mode=mode), served_model=st.booleans())
    @settings(max_examples=examples, deadline=None, derandomize=FIXED_SEED, database=None,
              suppress_health_check=list(HealthCheck))
    def one_case(case, served_model):
        # Get past the model check to the engine more often (not in negative cases: the model
        # may be the very field made invalid, and replacing it would make the case valid).
        if served_model and mode is GenerationMode.POSITIVE and isinstance(case.body, dict) \
                and "model" in case.body:
            case.body["model"] = MODEL_NAME
        response = case.call(base_url=fuzz_server.base_url, timeout=REQUEST_TIMEOUT_S)
        case.validate_response(response, checks=CHECKS)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
            assert isinstance(error["message"], str) and error["message"]

    one_case()


# -- past the schema: what schemathesis cannot send ---------------------------------------------
# Its strings are valid Unicode and its numbers fit JSON Schema, so it never sends what first
# crashed this server: a lone UTF-16 surrogate ("\udbee" is valid JSON, not valid text). These
# bodies use the real field names with any JSON value, surrogates, NaN, huge numbers and deep
# nesting included, plus bytes that are no JSON at all.

FIELDS = ["prompt", "messages", "model", "n", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed", "logprobs", "top_logprobs",
          "echo", "stream", "stream_options", "logit_bias", "presence_penalty", "min_tokens",
          "repetition_penalty", "ignore_eos", "cache_salt", "user", "add_generation_prompt",
          "skip_special_tokens", "include_stop_str_in_output", "prompt_logprobs", "allowed_token_ids",
          "bad_words", "return_tokens_as_token_ids", "chat_template_kwargs", "continue_final_message",
          "add_special_tokens", "tokens", "return_token_strs", "response_format", "best_of"]
# (st.text drops surrogates even from an explicit alphabet, hence lists of characters)
odd_text = st.lists(st.one_of(st.characters(), st.sampled_from(["\udbee", "\ud800", "\udfff", "\x00"])),
                    max_size=12).map("".join)
odd_number = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 2**63, 64, 65, 21]),
                       st.floats(allow_nan=True, allow_infinity=True))
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), odd_number, odd_text),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(st.sampled_from(["role", "content", "type", "text",
                                                                       "include_usage"]), odd_text),
                                            inner, max_size=4)),
    max_leaves=12)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]),
                                 "content": st.one_of(odd_text, json_values)})
bodies = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6).map(lambda d: {**d, "max_tokens": 4}),
    st.fixed_dictionaries({"prompt": st.one_of(odd_text, json_values), "max_tokens": st.integers(1, 4)},
                          optional={k: json_values for k in ("n", "stop", "logprobs", "echo", "stream")}),
    st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=3), "max_tokens": st.just(4)},
                          optional={k: json_values for k in ("n", "stop", "logprobs", "top_logprobs",
                                                             "stream")}),
    json_values)


def raw_body(body) -> bytes:
    # ensure_ascii spells surrogates as \u escapes; allow_nan writes NaN and Infinity, which
    # Python's JSON parser (and so the server's) accepts.
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


@pytest.mark.parametrize("path", sorted(WITH_BODY))
def test_fuzz_bodies_past_the_schema(fuzz_server, path):
    @given(body=st.one_of(bodies.map(raw_body), st.binary(max_size=64)))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=FIXED_SEED, database=None,
              suppress_health_check=list(HealthCheck))
    def one_body(body):
        response = httpx.post(f"{fuzz_server.base_url}{path}", content=body, timeout=REQUEST_TIMEOUT_S,
                              headers={"Content-Type": "application/json"})
        assert response.status_code < 500, (body, response.text)
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        elif not response.headers["content-type"].startswith("text/event-stream"):  # "stream": "yes" too
            assert response.json()[ANSWER_KEY[path]]

    one_body()


def test_healthy_and_idle_after_fuzzing(fuzz_server):
    assert httpx.get(f"{fuzz_server.base_url}/health").status_code == 200
    snap = fuzz_server.wait_idle(timeout_s=60)
    assert snap.kv.num_used_blocks == 0 and snap.kv.num_free_blocks == snap.kv.num_blocks
    assert not fuzz_server.async_engine._streams
    ok = httpx.post(f"{fuzz_server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200
