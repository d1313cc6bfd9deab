"""--max-logprobs (EngineConfig.max_logprobs, vLLM's): -1 lets logprobs, top_logprobs and
prompt_logprobs list the whole vocabulary, over the official openai client and offline, each value
transformers' log_softmax; a count past the cap is refused naming the field, in the server (a 400)
and offline; the default (20) is tests/server/test_vllm_extras.py's and test_limits.py's."""

from __future__ import annotations

import math

import openai
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.core import EngineCore
from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.sampling_bounds import MAX_LOGPROBS
from pagedllm.server.protocol import (
    MAX_PROMPT_LOGPROB_ENTRIES,
    MAX_PROMPT_LOGPROB_ENTRIES_RAISED_CAP,
    prompt_logprob_budget,
)
from tests.hf_logprobs import forward_logprobs as transformers_logprobs
from tests.server.conftest import MODEL_NAME, RunningServer, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 300  # tests/model/tiny.py's vocabulary
PROMPT_IDS = [84, 104, 101, 32, 99, 97, 116]  # "The cat"


@pytest.fixture(scope="module")
def forward_logprobs(tiny_model_dir):
    """log_softmax of transformers' forward pass over a prompt: [positions, vocab]."""
    return transformers_logprobs(tiny_model_dir)


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    with RunningServer(tiny_config(tiny_model_dir, max_logprobs=-1)) as running:
        yield openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)


def assert_whole_vocabulary(values: dict[int, float], expected: torch.Tensor) -> None:
    assert sorted(values) == list(range(VOCAB))
    for token_id, value in values.items():
        assert value == pytest.approx(expected[token_id].item(), abs=1e-4)


def test_minus_one_lists_the_whole_vocabulary_in_completions(client, forward_logprobs):
    done = client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=1, temperature=0,
                                     logprobs=-1, extra_body={"prompt_logprobs": -1,
                                                              "return_tokens_as_token_ids": True})
    expected = forward_logprobs(PROMPT_IDS)
    (top,) = done.choices[0].logprobs.top_logprobs
    assert_whole_vocabulary({int(k.removeprefix("token_id:")): v for k, v in top.items()}, expected[-1])
    prompt_entries = done.choices[0].model_extra["prompt_logprobs"]
    assert prompt_entries[0] is None and len(prompt_entries) == len(PROMPT_IDS)
    for position, entry in enumerate(prompt_entries[1:]):
        assert_whole_vocabulary({int(k): e["logprob"] for k, e in entry.items()}, expected[position])


def test_minus_one_lists_the_whole_vocabulary_in_chat(client):
    messages = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=3, temperature=0,
                                           logprobs=True, top_logprobs=-1, extra_body={"ignore_eos": True})
    best = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=3, temperature=0,
                                          logprobs=True, top_logprobs=MAX_LOGPROBS,
                                          extra_body={"ignore_eos": True})
    for every, few in zip(whole.choices[0].logprobs.content, best.choices[0].logprobs.content, strict=True):
        values = [t.logprob for t in every.top_logprobs]
        assert len(values) == VOCAB
        assert math.fsum(math.exp(v) for v in values) == pytest.approx(1.0, abs=1e-4)  # a distribution
        assert values[:MAX_LOGPROBS] == pytest.approx([t.logprob for t in few.top_logprobs], abs=1e-6)
        assert values == sorted(values, reverse=True)


@pytest.mark.parametrize("kind, fields, param", [
    ("completions", {"logprobs": VOCAB + 1}, "logprobs"),
    ("completions", {"extra_body": {"prompt_logprobs": VOCAB + 1}}, "prompt_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": VOCAB + 1}, "top_logprobs"),
])
def test_a_count_past_the_vocabulary_is_refused_naming_the_field(client, kind, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        if kind == "chat":
            client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=1, **fields)
        else:
            client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1, **fields)
    error = caught.value.body
    assert error["param"] == param, error
    assert f"at most {VOCAB}" in error["message"] and "vocabulary" in error["message"]


def test_a_raised_cap_raises_the_prompt_logprobs_budget_of_a_request(client):
    """vLLM's test_chat_echo asks a server started with a raised --max-logprobs for the whole
    vocabulary at each prompt token: past the default cap's budget of entries a request gets the
    larger one (still bounded: an unbounded one would let one long prompt take tens of GB)."""
    prompts = [list(range(1, 61))] * 4  # 4 x 60 tokens x (300 + 1) entries: past 65,536
    assert 4 * 60 * (VOCAB + 1) > MAX_PROMPT_LOGPROB_ENTRIES
    done = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=1,
                                     extra_body={"prompt_logprobs": -1})
    for choice in done.choices:
        entries = choice.model_extra["prompt_logprobs"]
        assert entries[0] is None and all(len(entry) == VOCAB for entry in entries[1:])
    assert [prompt_logprob_budget(cap) for cap in (1, MAX_LOGPROBS, MAX_LOGPROBS + 1, -1)] == \
        [MAX_PROMPT_LOGPROB_ENTRIES] * 2 + [MAX_PROMPT_LOGPROB_ENTRIES_RAISED_CAP] * 2


def test_a_raised_cap_below_the_vocabulary_is_the_servers_bound(tiny_model_dir):
    with RunningServer(tiny_config(tiny_model_dir, max_logprobs=30)) as running:
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)
        done = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1, logprobs=30,
                                         extra_body={"return_tokens_as_token_ids": True})
        assert len(done.choices[0].logprobs.top_logprobs[0]) >= 30  # the chosen token may be extra
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=1, logprobs=True, top_logprobs=31)
        error = caught.value.body
        assert error["param"] == "top_logprobs"
        assert "at most 30" in error["message"] and "--max-logprobs" in error["message"]
        with pytest.raises(openai.BadRequestError, match="top_logprobs=-1 .* 300 tokens"):
            client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=1, logprobs=True, top_logprobs=-1)


# -- offline ---------------------------------------------------------------------------------------

def test_offline_minus_one_is_the_whole_vocabulary_under_max_logprobs_minus_one(tiny_model_dir,
                                                                               forward_logprobs):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, block_size=16, max_logprobs=-1)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=-1, prompt_logprobs=-1)
    (out,) = llm.generate({"prompt_token_ids": PROMPT_IDS}, params, use_tqdm=False)
    expected = forward_logprobs(PROMPT_IDS)
    (step,) = out.outputs[0].logprobs
    assert_whole_vocabulary({t: lp.logprob for t, lp in step.items()}, expected[-1])
    assert out.prompt_logprobs[0] is None
    for position, entry in enumerate(out.prompt_logprobs[1:]):
        assert_whole_vocabulary({t: lp.logprob for t, lp in entry.items()}, expected[position])
    with pytest.raises(ValueError, match=r"logprobs must be at most 300 \(the model's vocabulary"):
        llm.generate("hi", SamplingParams(max_tokens=1, logprobs=VOCAB + 1), use_tqdm=False)


def test_offline_cap_is_the_engines_and_the_core_checks_it_too(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, block_size=16, max_logprobs=5)
    (out,) = llm.generate("hi", SamplingParams(max_tokens=1, logprobs=5), use_tqdm=False)
    assert len(out.outputs[0].logprobs[0]) >= 5
    for fields, name in (({"logprobs": 6}, "logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs")):
        with pytest.raises(ValueError, match=rf"^{name} must be at most 5 .*--max-logprobs"):
            llm.generate("hi", SamplingParams(max_tokens=1, **fields), use_tqdm=False)
    # A request that skipped the input processor (decoded from another client of the core).
    core: EngineCore = llm.engine.engine_core
    request = EngineCoreRequest("past-the-cap", [104, 105], SamplingParams(max_tokens=1, logprobs=6),
                                eos_token_ids=(), arrival_time=0.0)
    with pytest.raises(ValueError, match="logprobs must be at most 5"):
        core.add_request(request)


def test_max_logprobs_flag_and_its_default():
    from pagedllm.cli import build_parser
    from pagedllm.config import EngineConfig, engine_config_from_args

    assert EngineConfig().max_logprobs == MAX_LOGPROBS == 20
    for flags, want in (([], MAX_LOGPROBS), (["--max-logprobs", "-1"], -1), (["--max-logprobs", "64"], 64)):
        args = build_parser().parse_args(["serve", *flags])
        assert engine_config_from_args(args).max_logprobs == want
    with pytest.raises(ValueError, match="max_logprobs must be a non-negative integer or -1"):
        EngineConfig(max_logprobs=-2)


def test_beam_width_follows_a_lower_cap_and_keeps_the_default_bound_above_it():
    from types import SimpleNamespace

    from pagedllm.server.beam_search import beam_settings
    from pagedllm.server.protocol import APIError

    def body(n):
        return SimpleNamespace(n=n, length_penalty=1.0, early_stopping=False, skip_special_tokens=True,
                               ignore_eos=False)

    assert beam_settings(body(10), logprobs_cap=VOCAB).width == 10  # a raised cap: still 10
    with pytest.raises(APIError, match="at most 10 .* at most 20"):
        beam_settings(body(11), logprobs_cap=VOCAB)
    assert beam_settings(body(2), logprobs_cap=5).width == 2  # each beam asks for 2n alternatives
    with pytest.raises(APIError, match="at most 2 .* at most 5"):
        beam_settings(body(3), logprobs_cap=5)
