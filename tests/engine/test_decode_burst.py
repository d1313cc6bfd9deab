"""Decode bursts (pagedllm.engine.decode_burst) on a tiny random model in float32: greedy tokens
and finish reasons equal those of one decode step per engine step, through stops inside a burst
(EOS, stop ids, stop strings, max_tokens), preemption, prefix-cache hits and n = 3; every block
free after; and bursts run only where their rule says (counted in engine steps)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.engine.test_llm_engine import assert_all_blocks_free

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 10, 11, 12], list(range(20, 50)), [3, 4] * 8]


def make_llm(model_dir, burst: int, **overrides) -> LLM:
    torch.set_num_threads(1)
    settings = dict(model=str(model_dir), dtype="float32", block_size=4, num_kv_blocks=256,
                    max_model_len=256, enable_prefix_caching=False, decode_burst=burst)
    return LLM(**{**settings, **overrides})


def generate(llm: LLM, params, prompts=PROMPTS) -> list:
    """Each output's tokens, text and finish reason, by prompt."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(o.token_ids, o.text, o.finish_reason) for o in r.outputs] for r in outputs]


def count_steps(llm: LLM, prompt: list[int], params: SamplingParams) -> int:
    llm.engine.add_request("counted", {"prompt_token_ids": prompt}, params)
    steps = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        steps += 1
    return steps


@pytest.fixture(scope="module")
def plain(tiny_model_dir) -> LLM:
    return make_llm(tiny_model_dir, 1)


@pytest.fixture(scope="module")
def bursting(tiny_model_dir) -> LLM:
    return make_llm(tiny_model_dir, 5)


def test_a_lone_stream_takes_one_engine_step_per_burst(plain, bursting):
    params = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    assert count_steps(plain, PROMPTS[0], params) == 13  # the prompt's step gives the first token
    assert count_steps(bursting, PROMPTS[0], params) == 1 + 3  # then 12 in bursts of 5, 5 and 2
    assert_all_blocks_free(bursting)


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 6, 9, 23])
@pytest.mark.parametrize("count", [1, 2, 4])
def test_greedy_tokens_equal_one_step_at_a_time(plain, bursting, max_tokens, count):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    assert generate(bursting, params, PROMPTS[:count]) == generate(plain, params, PROMPTS[:count])
    assert_all_blocks_free(bursting)


def test_stops_inside_a_burst_end_the_request_there(plain, bursting):
    """A stop id, EOS and a stop string met in the middle of a burst: the tokens after it are
    dropped and their slots given back, as a plain run never made them."""
    reference = generate(plain, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    tokens = [r[0][0] for r in reference]
    stop_ids = [t[7] for t in tokens]  # each stream's 8th token, mid-burst (bursts of 5 from token 2)
    for params in (SamplingParams(temperature=0, max_tokens=30, stop_token_ids=stop_ids),
                   SamplingParams(temperature=0, max_tokens=30, stop=[reference[0][0][1][10:14]]),
                   SamplingParams(temperature=0, max_tokens=30)):
        got = generate(bursting, params)
        assert got == generate(plain, params)
        assert_all_blocks_free(bursting)
    assert any(len(r[0][0]) < 30 for r in generate(bursting, SamplingParams(
        temperature=0, max_tokens=30, stop_token_ids=stop_ids))), "no stream stopped early"


def test_preemption_prefix_hits_and_n(tiny_model_dir, plain):
    tight = make_llm(tiny_model_dir, 5, num_kv_blocks=24, max_model_len=64, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = PROMPTS[:2] + [PROMPTS[1]] + [PROMPTS[3]]
    assert generate(tight, params, prompts) == generate(plain, params, prompts)
    assert tight.memory_stats()["num_preemptions"] > 0
    assert_all_blocks_free(tight)
    three = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3)
    assert generate(tight, three, PROMPTS[:1]) == generate(plain, three, PROMPTS[:1])
    assert_all_blocks_free(tight)


@pytest.mark.parametrize("params,prompts", [
    (SamplingParams(temperature=0, max_tokens=13, ignore_eos=True, logprobs=1), PROMPTS[:1]),
    (SamplingParams(temperature=0.8, max_tokens=13, ignore_eos=True, seed=1), PROMPTS[:1]),
    (SamplingParams(temperature=0, max_tokens=13, ignore_eos=True), PROMPTS + PROMPTS[:1]),  # 5 running
])
def test_no_burst_where_the_rule_says_no(bursting, plain, params, prompts):
    """Logprobs, sampling or more than BURST_MAX_SEQS streams: one decode step per engine step."""
    for prompt in prompts[1:]:
        bursting.engine.add_request(f"beside-{len(prompt)}-{prompt[0]}", {"prompt_token_ids": prompt}, params)
    assert count_steps(bursting, prompts[0], params) == 13
    assert_all_blocks_free(bursting)


def test_bursts_can_be_turned_off_and_are_checked(tiny_model_dir):
    with pytest.raises(ValueError, match="decode_burst"):
        make_llm(tiny_model_dir, 0)


def test_a_stop_inside_a_burst_caches_the_blocks_it_computed(tiny_model_dir, plain):
    """The tokens before the stop have K/V: their full blocks enter the prefix cache when the
    request ends, as a plain run's do (the scheduler counts them computed)."""
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    tokens = generate(plain, greedy, PROMPTS[:2])[1][0][0]
    # Bursts of 5 give outputs 2-6, 7-11, 12-16: a stop at output 16 (index 15) leaves 3 computed
    # tokens of the last burst, which fill the prompt's (8 tokens) 6th block of 4.
    assert tokens[15] not in tokens[:15], tokens
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tokens[15]])
    cached = {}
    for burst in (1, 5):
        llm = make_llm(tiny_model_dir, burst, enable_prefix_caching=True)
        assert generate(llm, params, PROMPTS[1:2])[0][0][0] == tokens[:16]
        cached[burst] = llm.memory_stats()["num_cached_free_blocks"]
    assert cached[5] == cached[1] == (8 + 15) // 4
