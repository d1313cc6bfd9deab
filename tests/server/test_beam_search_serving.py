"""use_beam_search on the server returns the offline beam search's beams (LLM.beam_search, the
same tiny model in float32): the same token ids, texts, finish reasons and order, on
/v1/completions and /v1/chat/completions, whole and streamed, with length_penalty and
early_stopping; and what a beam search cannot honour is a 400 naming the field."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from pagedllm import LLM
from tests.server.conftest import MODEL_NAME, RunningServer, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "The cat"
WIDTH, MAX_TOKENS = 3, 8


def with_eos(tiny_model_dir, folder, eos_ids: list[int]):
    for item in tiny_model_dir.iterdir():
        shutil.copy(item, folder / item.name)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    return LLM(str(folder), dtype="float32", num_kv_blocks=64, generation_config="none")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with end-of-generation ids its beams write: the best beam's first token,
    then a token the beams still going after that write fourth, so that beams end on EOS as well
    as at max_tokens, and early stopping cuts searches short (test_the_searches_end_both_ways)."""
    plain = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, generation_config="none")
    first = plain.beam_search(PROMPT, WIDTH, MAX_TOKENS)[0].sequences[0].token_ids[0]
    folder = tmp_path_factory.mktemp("beam-model")
    one_eos = with_eos(tiny_model_dir, folder, [first]).beam_search(PROMPT, WIDTH, MAX_TOKENS)[0]
    going_on = next(s for s in one_eos.sequences if s.finish_reason == "length")
    with_eos(tiny_model_dir, folder, [first, going_on.token_ids[3]])
    return folder


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=64, generation_config="none")


@pytest.fixture(scope="module")
def server(model_dir):
    with RunningServer(tiny_config(model_dir), with_hooks=False) as running:
        yield running


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json={"model": MODEL_NAME, **body}, timeout=300)


def streamed_choices(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}{path}", json={"model": MODEL_NAME, "stream": True, **body},
                      timeout=300) as response:
        assert response.status_code == 200, response.read()
        chunks = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                  if line.startswith("data: {")]
    return [choice for chunk in chunks for choice in chunk["choices"] if choice.get("token_ids")]


@pytest.mark.parametrize(("length_penalty", "early_stopping"),
                         [(1.0, False), (1.0, True), (0.5, True), (2.0, False), (2.0, True)])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_server_beams_are_the_offline_beams(server, offline, endpoint, length_penalty, early_stopping):
    body = {"use_beam_search": True, "n": WIDTH, "max_tokens": MAX_TOKENS, "length_penalty": length_penalty,
            "early_stopping": early_stopping, "return_token_ids": True}
    if endpoint == "chat":
        messages = [{"role": "user", "content": PROMPT}]
        prompt_ids = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
        path, body = "/v1/chat/completions", {**body, "messages": messages}
    else:
        prompt_ids = post(server, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
        path, body = "/v1/completions", {**body, "prompt": PROMPT}
    expected = offline.beam_search([prompt_ids], WIDTH, MAX_TOKENS, length_penalty, early_stopping)[0]
    answer = post(server, path, body)
    assert answer.status_code == 200, answer.text
    choices = answer.json()["choices"]
    assert [c["token_ids"] for c in choices] == [s.token_ids for s in expected.sequences]
    assert [c["finish_reason"] for c in choices] == [s.finish_reason for s in expected.sequences]
    texts = [c["text"] if endpoint == "completions" else c["message"]["content"] for c in choices]
    assert texts == [s.text for s in expected.sequences]
    assert answer.json()["usage"]["completion_tokens"] == sum(len(s.token_ids) for s in expected.sequences)
    streamed = streamed_choices(server, path, body)
    assert [(c["index"], c["token_ids"]) for c in streamed] == [(c["index"], c["token_ids"]) for c in choices]


def test_the_searches_end_both_ways(offline):
    """The cases above reach both ends of a beam (an EOS, max_tokens), and early stopping
    changes what some of them return."""
    sequences = offline.beam_search(PROMPT, WIDTH, MAX_TOKENS)[0].sequences
    assert {s.finish_reason for s in sequences} == {"stop", "length"}
    changed = [lp for lp in (1.0, 2.0) if offline.beam_search(PROMPT, WIDTH, MAX_TOKENS, lp)[0].sequences
               != offline.beam_search(PROMPT, WIDTH, MAX_TOKENS, lp, early_stopping=True)[0].sequences]
    assert changed


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", 0.7), ("top_p", 0.5), ("logprobs", 2), ("stop", ["x"]), ("n", 11),
    ("logit_bias", {"5": 1}), ("min_tokens", 2), ("guided_regex", "a+"),
])
def test_what_a_beam_search_cannot_honour_is_refused(server, field, value):
    answer = post(server, "/v1/completions", {"prompt": PROMPT, "use_beam_search": True, "max_tokens": 4,
                                              field: value})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text
