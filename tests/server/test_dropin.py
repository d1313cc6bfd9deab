"""A drop-in for clients written for vLLM and OpenAI, on the tiny model with a generation_config.json
that lists two more end-of-generation ids and makes unset sampling greedy: stops at every EOS id,
sampling defaults and their overrides, min_tokens against ignore_eos, fields refused or logged,
echo + logprobs against a separate forward pass, prompt_logprobs, logit_bias / allowed_token_ids /
bad_words, /tokenize and /detokenize, chat template options, prefix-cache hits in the usage, CORS,
and `pagedllm serve MODEL`. Through the official openai client where it can send the request,
raw HTTP elsewhere."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.server.answer_options import AnswerOptions
from pagedllm.server.app import Cors
from pagedllm.server.protocol import NOT_IMPLEMENTED_FIELDS
from tests.conftest import wait_until_healthy
from tests.hf_logprobs import forward_logprobs as transformers_logprobs
from tests.model.tiny import CHAT_TEMPLATE
from tests.server.conftest import API_KEY, MODEL_NAME, RunningServer, free_port, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EOS = 257  # the tiny tokenizer's own
CANDIDATE_PROMPTS = ["Hello", "abc", "The cat", "xyz!", "0123", "Once upon", "tiny", "qwerty"]
# The server's chat template: the model's, plus a variable a request may set.
SERVER_TEMPLATE = CHAT_TEMPLATE + "{% if flavour %}[{{ flavour }}]{% endif %}"


def greedy_ids(llm: LLM, prompt: str, max_tokens: int = 8, **params) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def first_new(ids: list[int], position: int) -> int | None:
    """ids[position] if it is an ASCII byte that does not come earlier (so the model reaches it
    exactly there), else None."""
    token = ids[position]
    return token if token < 128 and token not in ids[:position] else None


@pytest.fixture(scope="module")
def stops(tiny_model_dir):
    """Two prompts, each with an ASCII token its greedy output reaches first at a known position
    (and the other's never before its own): the extra EOS ids. {prompt: (token, position)}."""
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, generation_config="none")
    outputs = {p: greedy_ids(llm, p) for p in CANDIDATE_PROMPTS}
    for a in CANDIDATE_PROMPTS:
        for b in CANDIDATE_PROMPTS:
            x1, x2 = first_new(outputs[a], 2), first_new(outputs[b], 3)
            if a != b and x1 and x2 and x1 != x2 and x1 not in outputs[b][:4] \
                    and x2 not in outputs[a][:3] and EOS not in outputs[a][:3] + outputs[b][:4]:
                return {a: (x1, 2), b: (x2, 3)}
    pytest.fail(f"no prompts with suitable stops in {outputs}")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, stops, tmp_path_factory):
    folder = tmp_path_factory.mktemp("dropin-model")
    for item in tiny_model_dir.iterdir():
        shutil.copy(item, folder / item.name)
    extra_eos = [token for token, _ in stops.values()]
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": extra_eos, "top_k": 1, "temperature": 1.0}))
    return folder


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same model offline without the generation defaults, for exact comparisons."""
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=64, generation_config="none")


@pytest.fixture(scope="module")
def server(model_dir):
    config = tiny_config(model_dir, block_size=4, enable_prefix_caching=True)
    with RunningServer(config, chat_template=SERVER_TEMPLATE,
                       options=AnswerOptions(prompt_tokens_details=True)) as running:
        yield running


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def ids_of(logprobs_tokens: list[str]) -> list[int]:
    """Token ids from logprobs named with return_tokens_as_token_ids."""
    return [int(t.removeprefix("token_id:")) for t in logprobs_tokens]


def completion_ids(server, prompt, **fields) -> tuple[list[int], str]:
    out = client(server).completions.create(
        model=MODEL_NAME, prompt=prompt, logprobs=0,
        extra_body={"return_tokens_as_token_ids": True, **fields.pop("extra_body", {})}, **fields)
    choice = out.choices[0]
    return ids_of(choice.logprobs.tokens), choice.finish_reason


# -- where generation stops -----------------------------------------------------------------------

def test_every_eos_id_of_the_model_stops_generation(server, stops):
    for prompt, (token, position) in stops.items():
        ids, finish = completion_ids(server, prompt, max_tokens=8)
        assert (ids, finish) == (ids[:position] + [token], "stop"), (prompt, token)
        ignored, finish = completion_ids(server, prompt, max_tokens=8, extra_body={"ignore_eos": True})
        assert len(ignored) == 8 and ignored[position] == token and finish == "length"


def test_min_tokens_with_ignore_eos_never_yields_an_eos_before_min_tokens(server, stops, reference):
    eos_ids = {EOS} | {token for token, _ in stops.values()}
    for prompt, (token, position) in stops.items():
        ids, finish = completion_ids(server, prompt, max_tokens=6,
                                     extra_body={"ignore_eos": True, "min_tokens": 6})
        assert len(ids) == 6 and finish == "length" and not eos_ids & set(ids), (prompt, ids)
        # The model's first choice there was an EOS id: the ban changed the token.
        free = greedy_ids(reference, prompt, 6)
        assert free[position] == token and ids[position] != token


# -- sampling defaults ------------------------------------------------------------------------------

def test_generation_config_defaults_apply_unless_the_request_sets_the_field(server, reference):
    prompt = "Once upon"
    greedy = greedy_ids(reference, prompt, 8)
    # top_k 1 from generation_config.json: whatever the seed, the greedy tokens.
    for seed in (1, 2):
        ids, _ = completion_ids(server, prompt, max_tokens=8, seed=seed, extra_body={"ignore_eos": True})
        assert ids == greedy
    # top_k set by the request: sampled from every token, exactly as offline with that seed.
    for seed in (1, 2):
        ids, _ = completion_ids(server, prompt, max_tokens=8, seed=seed,
                                extra_body={"ignore_eos": True, "top_k": -1})
        offline = reference.generate(prompt, SamplingParams(seed=seed, max_tokens=8, ignore_eos=True),
                                     use_tqdm=False)[0].outputs[0].token_ids
        assert ids == offline
    assert ids != greedy


# -- fields the server does not define -----------------------------------------------------------

@pytest.mark.parametrize("name", sorted(NOT_IMPLEMENTED_FIELDS))
def test_every_unsupported_field_gives_a_400_naming_it(server, name):
    value = {"response_format": {"type": "json_object"}, "tools": [{"type": "function"}],
             "tool_choice": "auto", "best_of": 3, "modalities": ["audio"],
             "length_penalty": 0.5}.get(name, "x")
    for path, body in [("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2})]:
        response = post(server, path, {**body, name: value})
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert error["param"] == name and name in error["message"]
    off = {name: off_values[0]} if (off_values := NOT_IMPLEMENTED_FIELDS[name]) else {name: None}
    assert post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2, **off}).status_code == 200


def test_unknown_fields_are_logged_once_per_name_with_the_request_id(server, caplog):
    body = {"prompt": "hi", "max_tokens": 2, "frobnicate": 1, "stream_options": None,
            "messages_extra": {"a": 1}}
    with caplog.at_level(logging.WARNING, logger="pagedllm.server.protocol"):
        first = post(server, "/v1/completions", body)
        second = post(server, "/v1/completions", body)
        chat = post(server, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi", "weight": 7}], "max_tokens": 2,
            "service_tier": "auto"})
    assert first.status_code == second.status_code == chat.status_code == 200
    lines = [r.getMessage() for r in caplog.records if "ignored fields" in r.getMessage()]
    assert len(lines) == 2, lines
    assert first.json()["id"] in lines[0] and "'frobnicate'" in lines[0] and "'messages_extra'" in lines[0]
    assert chat.json()["id"] in lines[1]
    assert "'messages[].weight'" in lines[1] and "'service_tier'" in lines[1]


# -- logprobs ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def forward_logprobs(model_dir):
    """log_softmax of transformers' forward pass over a prompt: [positions, vocab]."""
    return transformers_logprobs(model_dir)


PROMPT_IDS = [84, 104, 101, 32, 99, 97, 116, 32, 115, 97, 116, 32, 111, 110]  # "The cat sat on"


def test_echo_with_logprobs_gives_the_prompts_logprobs_of_a_separate_forward_pass(server, forward_logprobs):
    expected = forward_logprobs(PROMPT_IDS)
    out = client(server).completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=1,
                                            echo=True, logprobs=2, temperature=0)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith("The cat sat on") and len(lp.tokens) == len(PROMPT_IDS) + 1
    assert lp.tokens[:len(PROMPT_IDS)] == [chr(t) for t in PROMPT_IDS]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(PROMPT_IDS)):
        assert lp.token_logprobs[i] == pytest.approx(expected[i - 1, PROMPT_IDS[i]].item(), abs=1e-4)
    assert lp.token_logprobs[-1] == pytest.approx(expected[-1].max().item(), abs=1e-4)  # greedy
    assert lp.text_offset[:len(PROMPT_IDS)] == list(range(len(PROMPT_IDS)))  # a character a token
    # The top alternatives, named by id (several bytes above 127 all decode to "\ufffd").
    by_id = client(server).completions.create(
        model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=1, echo=True, logprobs=2, temperature=0,
        extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    assert ids_of(by_id.tokens[:-1]) == PROMPT_IDS and by_id.token_logprobs == lp.token_logprobs
    for i in range(1, len(PROMPT_IDS)):
        top_values, top_ids = expected[i - 1].topk(2)
        tops = {int(k.removeprefix("token_id:")): v for k, v in by_id.top_logprobs[i].items()}
        assert set(top_ids.tolist()) <= set(tops)
        for token_id, value in zip(top_ids.tolist(), top_values.tolist()):
            assert tops[token_id] == pytest.approx(value, abs=1e-4)
    # What lm-eval's loglikelihood sums, streamed or not.
    chunks = list(client(server).completions.create(
        model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=1, echo=True, logprobs=2, temperature=0,
        stream=True))
    streamed = [v for c in chunks for ch in c.choices if ch.logprobs for v in ch.logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    assert "".join(ch.text for c in chunks for ch in c.choices) == choice.text
    # Every choice of n echoes the prompt with its logprobs, once.
    chunks = list(client(server).completions.create(
        model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=3, echo=True, logprobs=0, n=2, seed=5,
        stream=True, extra_body={"top_k": -1, "ignore_eos": True}))
    for index in (0, 1):
        values = [v for c in chunks for ch in c.choices if ch.index == index
                  for v in ch.logprobs.token_logprobs]
        assert len(values) == len(PROMPT_IDS) + 3 and values[:len(PROMPT_IDS)] == lp.token_logprobs[:-1]


def test_prompt_logprobs_in_completions_and_chat(server, forward_logprobs):
    body = {"prompt": PROMPT_IDS, "max_tokens": 1, "prompt_logprobs": 1}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    expected = forward_logprobs(PROMPT_IDS)
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(PROMPT_IDS)
    for i, entry in enumerate(entries[1:], 1):
        given = entry[str(PROMPT_IDS[i])]
        assert given["logprob"] == pytest.approx(expected[i - 1, PROMPT_IDS[i]].item(), abs=1e-4)
        assert given["decoded_token"] == chr(PROMPT_IDS[i]) and given["rank"] >= 1
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    streamed = post(server, "/v1/completions", {**body, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


# -- token rules -----------------------------------------------------------------------------------

def test_logit_bias_allowed_token_ids_and_bad_words(server):
    a, b, c = ord("A"), ord("B"), ord("C")
    ids, _ = completion_ids(server, "hi", max_tokens=5, logit_bias={str(a): 100},
                            extra_body={"ignore_eos": True})
    assert ids == [a] * 5
    ids, _ = completion_ids(server, "hi", max_tokens=8, temperature=1.0, seed=3,
                            extra_body={"ignore_eos": True, "top_k": -1, "allowed_token_ids": [a, b, c]})
    assert set(ids) <= {a, b, c} and len(ids) == 8
    ids, _ = completion_ids(server, "hi", max_tokens=5, logit_bias={str(a): 100, str(b): 50},
                            extra_body={"ignore_eos": True, "bad_words": ["A"]})
    assert ids == [b] * 5
    chat = client(server).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        logit_bias={str(c): 100}, logprobs=True, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == "CCC"


@pytest.mark.parametrize("field,value,words", [
    ("logit_bias", {"x": 1, "7": 1, "1.5": 2}, ["'x'", "'1.5'", "not integers"]),
    ("logit_bias", {"300": 1, "5": 1, "1000": 2}, ["[300, 1000]", "[0, 300)"]),
    ("logit_bias", {"5": 101}, ["[-100, 100]"]),
    ("allowed_token_ids", [5, 300], ["[300]", "vocabulary"]),
    ("bad_words", [""], ["bad_words"]),
])
def test_token_rules_are_checked_with_every_bad_value_named(server, field, value, words):
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field
    for word in words:
        assert word in error["message"], error


# -- tokenization and chat templates ----------------------------------------------------------------

def test_tokenize_and_detokenize_round_trip(server):
    text = "héllo wörld 😀"
    tokens = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(text.encode())
    assert tokens["max_model_len"] == 64 and len(tokens["token_strs"]) == tokens["count"]
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": text}
    with_special = post(server, "/detokenize", {"tokens": [256, *tokens["tokens"]]}).json()
    assert with_special["prompt"] == "<|bos|>" + text
    bad = post(server, "/detokenize", {"tokens": [5, 300, 301]})
    assert bad.status_code == 400 and "[300, 301]" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "tokens"
    assert post(server, "/tokenize", {"prompt": "hi", "model": "other"}).status_code == 404


def test_chat_template_options_shape_the_prompt(server):
    messages = [{"role": "user", "content": "hi"}]

    def rendered(body: dict) -> str:
        response = post(server, "/tokenize", {"messages": messages, "return_token_strs": True, **body})
        assert response.status_code == 200, response.text
        return "".join(response.json()["token_strs"])

    assert rendered({}) == "<|bos|><user>hi<|eos|><assistant>"
    assert rendered({"chat_template_kwargs": {"flavour": "x"}}).endswith("<assistant>[x]")
    continued = [*messages, {"role": "assistant", "content": "Hel"}]
    assert "".join(post(server, "/tokenize", {
        "messages": continued, "add_generation_prompt": False, "continue_final_message": True,
        "return_token_strs": True}).json()["token_strs"]).endswith("<assistant>Hel")
    # The chat endpoint renders the same way: its usage counts the same tokens.
    count = post(server, "/tokenize", {"messages": messages,
                                       "chat_template_kwargs": {"flavour": "x"}}).json()["count"]
    chat = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1,
                                                 "chat_template_kwargs": {"flavour": "x"}})
    assert chat.json()["usage"]["prompt_tokens"] == count
    both = post(server, "/v1/chat/completions", {"messages": continued, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_add_special_tokens_on_completions(server):
    with_bos = post(server, "/tokenize", {"prompt": "<|bos|>hi"}).json()["tokens"]
    assert with_bos == [256, ord("h"), ord("i")]  # special tokens in the text stay whole
    usage = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1,
                                             "add_special_tokens": False}).json()["usage"]
    assert usage["prompt_tokens"] == 2


# -- prefix cache, CORS, the command line --------------------------------------------------------------

def test_cached_tokens_count_the_prefix_cache_hits_of_a_repeated_prompt(server):
    prompt = "A prompt long enough to fill several blocks of four tokens."
    first = client(server).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    again = client(server).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 4 == 0 and cached < again.usage.prompt_tokens

    def streamed_usage():  # the chat form, streamed: its usage chunk counts the hits too
        stream = client(server).chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Say it again, please."}],
            max_tokens=2, stream=True, stream_options={"include_usage": True})
        return [chunk.usage for chunk in stream if chunk.usage][0]

    # (Other chats share the template's first block.)
    before = streamed_usage().prompt_tokens_details.cached_tokens
    assert streamed_usage().prompt_tokens_details.cached_tokens > before


PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}


def test_cors_preflight_passes_only_when_enabled(server, model_dir):
    origin = "https://app.example"
    off = httpx.options(f"{server.base_url}/v1/completions", headers={"Origin": origin, **PREFLIGHT})
    assert off.status_code != 200 and "access-control-allow-origin" not in off.headers
    config = tiny_config(model_dir)
    with RunningServer(config, api_key=API_KEY, cors=Cors((origin,))) as running:
        url = f"{running.base_url}/v1/completions"
        ok = httpx.options(url, headers={"Origin": origin, **PREFLIGHT})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == origin
        other = httpx.options(url, headers={"Origin": "https://evil.example", **PREFLIGHT})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        # The real request still needs the key, and its answer carries the CORS header.
        answer = httpx.post(url, json={"prompt": "hi", "max_tokens": 1},
                            headers={"Origin": origin, "Authorization": f"Bearer {API_KEY}"})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == origin
        refused = httpx.post(url, json={"prompt": "hi", "max_tokens": 1}, headers={"Origin": origin})
        assert refused.status_code == 401


def test_pagedllm_serve_model_answers(model_dir):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    command = [sys.executable, "-m", "pagedllm.cli", "--log-level", "WARNING", "serve", str(model_dir),
               "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "8MiB",
               "--served-model-name", "tiny", "--chat-template", SERVER_TEMPLATE]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", 120,
                           lambda: None if process.poll() is None else process.stderr.read().decode(),
                           interval_s=0.2)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        assert c.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_the_readme_names_every_field_the_server_declares_or_refuses():
    from pagedllm.server.protocol import ChatCompletionRequest, CompletionRequest

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## API"):readme.index("## Watch the KV cache")]
    names = {*CompletionRequest.model_fields, *ChatCompletionRequest.model_fields, *NOT_IMPLEMENTED_FIELDS}
    missing = sorted(name for name in names if f"`{name}`" not in section)
    assert not missing, f"document these in the README's API section: {missing}"
