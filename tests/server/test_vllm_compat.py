"""Answers shaped as vLLM's, where clients switching from vLLM read them: logprobs lists (the chosen
token first, logprobs=0 giving it alone), /tokenize's vocabulary pieces, forced tool calls whose
parameters use $defs. On the tiny model (byte-level tokenizer), and the default model where a
forced call needs more room than the tiny model's 64 positions."""

from __future__ import annotations

import json
import re
from typing import Annotated

import httpx
import jsonschema
import pytest

from tests.server.conftest import MODEL_NAME, RunningServer, tiny_config

PROMPT = "The cat"


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir, one_torch_thread):
    with RunningServer(tiny_config(tiny_model_dir)) as running:
        yield running


def post(server, path: str, body: dict) -> httpx.Response:
    response = httpx.post(f"{server.base_url}{path}", json={"model": MODEL_NAME, **body}, timeout=120)
    return response


def ok(server, path: str, body: dict) -> dict:
    response = post(server, path, body)
    assert response.status_code == 200, response.text
    return response.json()


def token_id(name: str) -> int:
    return int(name.removeprefix("token_id:"))


def test_logprobs_zero_lists_the_chosen_token(tiny_server):
    choice = ok(tiny_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "logprobs": 0,
                                                 "temperature": 1.5, "seed": 3})["choices"][0]
    lp = choice["logprobs"]
    assert lp["top_logprobs"] == [{token: value} for token, value in zip(lp["tokens"], lp["token_logprobs"])]


def sampled(server, k: int, chat: bool) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """(chosen id, its logprob, [(id, logprob) listed]) per token of one seeded sample with k
    alternatives asked for."""
    common = {"max_tokens": 12, "temperature": 2.0, "seed": 7, "return_tokens_as_token_ids": True,
              "ignore_eos": True}
    if chat:
        body = {"messages": [{"role": "user", "content": PROMPT}], "logprobs": True, "top_logprobs": k}
        content = ok(server, "/v1/chat/completions", {**body, **common})["choices"][0]["logprobs"]["content"]
        return [(token_id(e["token"]), e["logprob"],
                 [(token_id(t["token"]), t["logprob"]) for t in e["top_logprobs"]]) for e in content]
    lp = ok(server, "/v1/completions", {"prompt": PROMPT, "logprobs": k, **common})["choices"][0]["logprobs"]
    return [(token_id(t), v, [(token_id(name), x) for name, x in top.items()])
            for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_top_logprobs_list_the_chosen_token_first_then_by_rank(tiny_server, chat):
    """vLLM's lists: the chosen token, then the others by rank; completions keep k + 1 entries at
    most (the chosen one and the best k), chat k (the chosen one and the best k - 1). The best
    others are read from the same seeded sample with 20 alternatives."""
    k = 3
    few, many = sampled(tiny_server, k, chat), sampled(tiny_server, 20, chat)
    assert [t for t, _, _ in few] == [t for t, _, _ in many]  # the same sample
    chosen_was_not_best = 0
    for (chosen, value, listed), (_, _, wide) in zip(few, many):
        assert listed[0] == (chosen, value)
        others = [(t, v) for t, v in wide[1:] if t != chosen]
        assert [v for _, v in others] == sorted((v for _, v in others), reverse=True)
        best_others = others[:k - 1] if chat else [
            (t, v) for t, v in sorted(wide, key=lambda item: -item[1])[:k] if t != chosen]
        assert listed[1:] == best_others
        chosen_was_not_best += value < max(v for _, v in wide)
    assert chosen_was_not_best  # the sample took a token that was not the best at least once


def test_tokenize_token_strs_are_vocabulary_pieces(tiny_server):
    tokens = ok(tiny_server, "/tokenize", {"prompt": "a is", "return_token_strs": True})
    assert tokens["token_strs"] == ["a", "Ġ", "i", "s"]  # byte-level BPE spells the space 'Ġ'
    chat = ok(tiny_server, "/tokenize", {"messages": [{"role": "user", "content": "a b"}],
                                         "return_token_strs": True})
    assert "Ġ" in chat["token_strs"] and "<|bos|>" in chat["token_strs"]


# A tool whose parameters name a definition twice.
ROUTE = {"type": "function", "function": {"name": "route", "parameters": {
    "type": "object", "$defs": {"Place": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Rome"]}}, "required": ["city"], "additionalProperties": False}},
    "properties": {"from": {"$ref": "#/$defs/Place"}, "to": {"$ref": "#/$defs/Place"}},
    "required": ["from", "to"], "additionalProperties": False}}}


def test_required_tool_choice_with_defs_gives_valid_calls(server):
    body = {"messages": [{"role": "user", "content": "Route from Paris to Rome, please."}],
            "tools": [ROUTE], "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 60, "temperature": 0}
    choice = ok(server, "/v1/chat/completions", body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "route"
    jsonschema.validate(json.loads(call["function"]["arguments"]), ROUTE["function"]["parameters"])


def test_tokenize_a_conversation_with_tools_as_the_chat_renders_it(server):
    """On the default model: the tools prompt needs more than the tiny model's 64 positions."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "x"}]
    with_tools = ok(server, "/tokenize", {"messages": messages, "tools": [tool]})
    without = ok(server, "/tokenize", {"messages": messages})
    assert with_tools["count"] > without["count"]
    chat = ok(server, "/v1/chat/completions", {"messages": messages, "tools": [tool], "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == with_tools["count"]
    bad = post(server, "/tokenize", {"messages": messages, "tools": [{"type": "nope"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"


def chat_texts(server, body: dict, path: str = "/v1/chat/completions") -> list[str]:
    answer = ok(server, path, {"max_tokens": 4, "temperature": 0, **body})
    return [choice["message"]["content"] for choice in answer["choices"]]


def streamed_text(server, body: dict) -> str:
    body = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        data = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    return "".join(json.loads(d)["choices"][0]["delta"].get("content") or "" for d in data[:-1]
                   if json.loads(d)["choices"])


def test_chat_echo_prepends_the_message_the_answer_continues(tiny_server):
    """vLLM's chat echo: the last message's text before the answer where the answer continues it
    (whole, streamed and per conversation of a batch); a user's last message under a generation
    prompt is not echoed."""
    said = "An apple a day"
    continued = {"messages": [{"role": "user", "content": "a saying"},
                              {"role": "assistant", "content": said}],
                 "add_generation_prompt": False, "continue_final_message": True}
    [plain] = chat_texts(tiny_server, continued)
    assert chat_texts(tiny_server, {**continued, "echo": True}) == [said + plain]
    assert streamed_text(tiny_server, {**continued, "echo": True}) == said + plain
    asked = {"messages": [{"role": "user", "content": said}]}
    assert chat_texts(tiny_server, {**asked, "echo": True}) == chat_texts(tiny_server, asked)
    batch = {"messages": [continued["messages"], [{"role": "assistant", "content": "Once"}]],
             "add_generation_prompt": False, "continue_final_message": True}
    plain_batch = chat_texts(tiny_server, batch, "/v1/chat/completions/batch")
    assert chat_texts(tiny_server, {**batch, "echo": True}, "/v1/chat/completions/batch") == [
        said + plain_batch[0], "Once" + plain_batch[1]]


def openai_client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("seed, error_type", [(-2**63 - 1, "greater_than_equal"),
                                              (2**63, "less_than_equal")])
def test_validation_errors_carry_pydantics_error_type(tiny_server, seed, error_type):
    """vLLM answers a field out of range with pydantic's own message, and its clients match on
    the error type (greater_than_equal); ours names the field and ends with that type."""
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        openai_client(tiny_server).chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], seed=seed)
    assert caught.value.body["message"].startswith("invalid request: seed must be")
    assert caught.value.body["message"].endswith(f"[{error_type}]")
    assert caught.value.body["param"] == "seed" and caught.value.body["code"] == error_type


def _bool_fields():
    """(body, field, its type) for every boolean field of every request body the server reads."""
    import inspect
    import typing

    from pydantic import BaseModel

    from pagedllm.server import anthropic, embeddings, protocol, rerank, responses

    def has_bool(annotation) -> bool:
        return annotation is bool or any(has_bool(arg) for arg in typing.get_args(annotation))

    for module in (protocol, embeddings, rerank, responses, anthropic):
        for name, body in inspect.getmembers(module, inspect.isclass):
            if issubclass(body, BaseModel) and body.__module__ == module.__name__:
                for field_name, field in body.model_fields.items():
                    if has_bool(field.annotation):
                        yield name, field_name, (Annotated[field.annotation, *field.metadata]
                                                 if field.metadata else field.annotation)


def test_boolean_fields_take_exactly_the_strings_pydantic_reads_as_booleans():
    """vLLM's bodies are pydantic's lax mode: `"logprobs": "true"` is true. Every boolean field of
    every body takes exactly the strings that mode takes, as it reads them, and refuses the rest."""
    from pydantic import TypeAdapter, ValidationError

    from pagedllm.server.protocol import BOOL_WORDS, ChatCompletionRequest

    lax = TypeAdapter(bool)
    words = [*BOOL_WORDS, "TRUE", "Yes", "oN", "F", "No", "True"]
    not_words = ["", " true", "true ", "2", "1.0", "maybe", "nope", "tru", "\u0130"]
    fields = list(_bool_fields())
    assert {("ChatCompletionRequest", "logprobs"), ("CompletionRequest", "echo"),
            ("StreamOptions", "include_usage"), ("EmbeddingRequest", "normalize")} <= \
        {(body, field) for body, field, _ in fields}
    for body, field, annotation in fields:
        adapter = TypeAdapter(annotation)
        for word in words:
            assert adapter.validate_python(word) is lax.validate_python(word), (body, field, word)
        for word in not_words:
            with pytest.raises(ValidationError):
                lax.validate_python(word)
            with pytest.raises(ValidationError):
                adapter.validate_python(word)
    # /openapi.json says the same (schemathesis's negative cases rely on it)
    pattern = ChatCompletionRequest.model_json_schema()["properties"]["logprobs"]["anyOf"][1]["pattern"]
    assert all(re.fullmatch(pattern, word) for word in words)
    assert not any(re.fullmatch(pattern, word) for word in not_words)


def test_a_boolean_sent_as_a_string_is_read_as_vllm_reads_it(tiny_server):
    """vLLM's test_chat_echo sends logprobs as the string "true"; other strings, and numbers, are
    still a 400 naming the field."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "temperature": 0,
            "top_logprobs": 2}
    content = ok(tiny_server, "/v1/chat/completions", {**body, "logprobs": "true"})["choices"][0]["logprobs"]
    assert len(content["content"]) == 3 and all(len(e["top_logprobs"]) == 2 for e in content["content"])
    off = ok(tiny_server, "/v1/chat/completions", {**body, "logprobs": "off"})
    assert off["choices"][0]["logprobs"] is None
    streamed = {"prompt": PROMPT, "max_tokens": 2, "stream": "yes"}
    assert post(tiny_server, "/v1/completions", streamed).text.endswith("data: [DONE]\n\n")
    for value in ("maybe", 1, [True]):
        refused = post(tiny_server, "/v1/chat/completions", {**body, "logprobs": value})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "logprobs" and error["code"] == "bool_type"
        assert error["message"] == \
            f"invalid request: logprobs must be a valid boolean; got {value!r} [bool_type]"


def test_completion_without_a_prompt_is_refused_in_vllms_words(tiny_server):
    import openai

    client = openai_client(tiny_server)
    for extra in ({}, {"prompt_embeds": []}):  # an empty prompt_embeds is no prompt either
        with pytest.raises(openai.BadRequestError, match="Either prompt or prompt_embeds must be "
                           "provided and non-empty.") as caught:
            client.completions.create(model=MODEL_NAME, prompt=None, max_tokens=2, extra_body=extra)
        assert caught.value.body["param"] == "prompt"
    refused = post(tiny_server, "/v1/completions", {"prompt": "x", "prompt_embeds": [[0.0]]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_embeds"


def test_usage_has_no_prompt_tokens_details_unless_the_flag_asks_as_vllm(tiny_server):
    """vLLM writes usage.prompt_tokens_details null unless --enable-prompt-tokens-details (its tests
    compare the whole usage object), whole or streamed, on both endpoints, even where the prefix
    cache served part of the prompt; the Responses API counts the cached tokens either way."""
    prompt = "A prompt of more than sixteen tokens"  # a byte each: one full block to cache
    for _ in range(2):
        usage = ok(tiny_server, "/v1/completions", {"prompt": prompt, "max_tokens": 2})["usage"]
        assert usage["prompt_tokens_details"] is None and usage["prompt_tokens"] == len(prompt)
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
    assert ok(tiny_server, "/v1/chat/completions", chat)["usage"]["prompt_tokens_details"] is None
    body = {"model": MODEL_NAME, **chat, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{tiny_server.base_url}/v1/chat/completions", json=body, timeout=120) as r:
        chunks = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert chunks[-1]["usage"]["prompt_tokens_details"] is None
    responses = [ok(tiny_server, "/v1/responses", {"input": prompt, "max_output_tokens": 2})["usage"]
                 for _ in range(2)]
    assert responses[1]["input_tokens_details"]["cached_tokens"] >= 16


def test_a_custom_role_reaches_the_template(tiny_server):
    """vLLM passes any role to the chat template: the prompt names it, and text given as a string
    or as text parts is the same prompt and the same answer."""
    as_text = [{"role": "my-custom-role", "content": "1+1?"}]
    as_parts = [{"role": "my-custom-role", "content": [{"type": "text", "text": "1+1?"}]}]
    tokens = ok(tiny_server, "/tokenize", {"messages": as_text})["tokens"]
    assert "my-custom-role" in ok(tiny_server, "/detokenize", {"tokens": tokens})["prompt"]
    assert ok(tiny_server, "/tokenize", {"messages": as_parts})["tokens"] == tokens
    assert chat_texts(tiny_server, {"messages": as_text}) == chat_texts(tiny_server, {"messages": as_parts})
    empty = post(tiny_server, "/v1/chat/completions", {"messages": [{"role": "", "content": "x"}]})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"


def test_sagemaker_invocations_answer_as_the_endpoint_the_body_picks(tiny_server):
    """/invocations: a chat body answers as /v1/chat/completions, a completion body as
    /v1/completions (the same choices, streamed too), bad fields as there; /ping is /health."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5, "temperature": 0}
    completion = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        direct, invoked = ok(tiny_server, path, body), ok(tiny_server, "/invocations", body)
        assert invoked["choices"] == direct["choices"] and invoked.keys() == direct.keys()
        assert invoked["object"] == direct["object"]
    streamed = post(tiny_server, "/invocations", {**completion, "stream": True})
    assert streamed.text.rstrip().endswith("data: [DONE]")
    bad = post(tiny_server, "/invocations", {**chat, "seed": 2**63})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "seed"
    neither = post(tiny_server, "/invocations", {"max_tokens": 3})
    assert neither.status_code == 400
    assert "messages (ChatCompletionRequest)" in neither.json()["error"]["message"]
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{tiny_server.base_url}/ping").status_code == 200


def test_truncate_prompt_tokens_keeps_the_side_asked_for(tiny_server):
    """vLLM's truncate_prompt_tokens with truncation_side (left: the last tokens, its default);
    the answer is the one the kept tokens alone give, and echo shows what was kept."""
    client = openai_client(tiny_server)
    ids = list(range(60, 68))

    def completion(prompt, **extra):
        return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0,
                                         extra_body={"return_token_ids": True, **extra}).choices[0]

    right = completion(ids, truncate_prompt_tokens=4, truncation_side="right")
    left = completion(ids, truncate_prompt_tokens=4)
    assert right.prompt_token_ids == ids[:4] and left.prompt_token_ids == ids[-4:]
    assert left.text == completion(ids[-4:]).text and right.text == completion(ids[:4]).text
    assert completion("abcdefgh", truncate_prompt_tokens=3, echo=True).text.startswith("fgh")
    # 200 tokens of text, past the 64-token context: cut to fit rather than refused
    long = ok(tiny_server, "/v1/completions", {"prompt": "a" * 200, "max_tokens": 1,
                                               "truncate_prompt_tokens": 60})
    assert long["usage"]["prompt_tokens"] == 60
    question = [{"role": "user", "content": "a long question"}]
    chat = ok(tiny_server, "/v1/chat/completions", {"messages": question, "max_tokens": 1,
                                                    "truncate_prompt_tokens": 5})
    assert chat["usage"]["prompt_tokens"] == 5
    bad = post(tiny_server, "/v1/completions", {"prompt": "hi", "truncation_side": "middle",
                                                "truncate_prompt_tokens": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncation_side"
