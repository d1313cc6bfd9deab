"""Speculative decoding through the engine (pagedllm.engine.speculation) on a tiny random model in
float32: greedy tokens equal the plain run's with each model-free proposer, through preemption,
prefix-cache hits, n = 3, a JSON schema, stop ids, max_tokens and logprobs; every block free after.

The prompts repeat themselves and a random model's greedy text falls into loops, so proposals are
made, some accepted and some rejected: each test checks the counters to know both paths ran.
"""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.engine.test_llm_engine import assert_all_blocks_free

METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
}
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 10, 11, 12],
           list(range(20, 60)), [3, 4] * 12, [100, 101, 102, 103, 100, 101]]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def make_llm(model_dir, spec=None, **overrides) -> LLM:
    torch.set_num_threads(1)
    settings = dict(model=str(model_dir), dtype="float32", block_size=4, num_kv_blocks=256,
                    max_model_len=256, enable_prefix_caching=False)
    return LLM(**{**settings, **overrides}, speculative_config=spec)


def generate(llm: LLM, params=GREEDY, prompts=PROMPTS) -> list[list[list[int]]]:
    """Every output's tokens, by prompt."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[o.token_ids for o in r.outputs] for r in outputs]


def spec_stats(llm: LLM) -> dict:
    return {k.removeprefix("spec_decode_"): v for k, v in llm.memory_stats().items()
            if k.startswith("spec_decode_")}


def assert_both_paths_ran(llm: LLM) -> None:
    stats = spec_stats(llm)
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats


@pytest.fixture(scope="module")
def plain(tiny_model_dir) -> LLM:
    return make_llm(tiny_model_dir)


@pytest.fixture(scope="module", params=list(METHODS))
def speculating(request, tiny_model_dir) -> LLM:
    return make_llm(tiny_model_dir, METHODS[request.param])


def test_greedy_tokens_equal_the_plain_runs(plain, speculating):
    assert generate(speculating) == generate(plain)
    assert_both_paths_ran(speculating)
    assert_all_blocks_free(speculating)


def test_streams_that_take_each_others_given_back_blocks_keep_their_tokens(plain, tiny_model_dir):
    """Proposals of 6 tokens over blocks of 4: a rejected run gives back a block, which the next
    step's first stream to grow may take before the one that gave it back grows again into
    others. Each runner row must follow its own list (SchedulerOutput.trimmed)."""
    spec = {**METHODS["ngram"], "num_speculative_tokens": 6}
    speculating = make_llm(tiny_model_dir, spec, decode_burst=1)
    runner = speculating.engine.engine_core.executor.runner
    prepare, checked = runner.prepare_inputs, []

    def prepare_and_check(scheduled, copies=()):  # each row is its request's whole block list
        step = prepare(scheduled, copies)
        for s in scheduled:
            row = runner.block_table.row_of(s.request.request_id)
            assert runner.block_table.table[row, :len(s.block_ids)].tolist() == s.block_ids
            checked.append(len(s.block_ids))
        return step

    runner.prepare_inputs = prepare_and_check
    assert generate(speculating) == generate(plain)
    assert checked
    assert_both_paths_ran(speculating)
    assert_all_blocks_free(speculating)


def test_greedy_tokens_survive_preemption_under_a_tight_budget(plain, tiny_model_dir):
    tight = make_llm(tiny_model_dir, METHODS["ngram"], num_kv_blocks=24, max_model_len=64)
    prompts = PROMPTS[:2] + PROMPTS[3:] + [p[:6] for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)
    assert generate(tight, params, prompts) == generate(plain, params, prompts)
    assert tight.memory_stats()["num_preemptions"] > 0
    assert_both_paths_ran(tight)
    assert_all_blocks_free(tight)


# Checks every method passes (the draft model's tests take them too).
def check_prefix_cache_hits_change_nothing(plain: LLM, cached: LLM) -> None:
    first = generate(cached)
    again = generate(cached)
    assert cached.memory_stats()["prefix_cache_hits"] > 0
    assert first == again == generate(plain)
    assert_both_paths_ran(cached)
    assert_all_blocks_free(cached)


def check_n_3_outputs_equal_the_plain_runs(plain: LLM, speculating: LLM) -> None:
    params = SamplingParams(n=3, temperature=0, max_tokens=30, ignore_eos=True)
    got = generate(speculating, params)
    assert got == generate(plain, params)
    assert all(len(outputs) == 3 for outputs in got)
    assert_all_blocks_free(speculating)


def check_a_json_schema_gives_the_plain_runs_text(plain: LLM, speculating: LLM) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 12}}, "required": ["a"]}
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": schema})
    prompts = ["hello hello hello", "abc abc abc abc"]
    want = [o.outputs[0].text for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].text for o in speculating.generate(prompts, params, use_tqdm=False)]
    assert got == want
    for text in got:
        json.loads(text)
    assert_all_blocks_free(speculating)


def test_prefix_cache_hits_change_nothing(plain, tiny_model_dir):
    check_prefix_cache_hits_change_nothing(plain, make_llm(tiny_model_dir, METHODS["ngram"],
                                                           enable_prefix_caching=True))


def test_n_3_outputs_each_equal_the_plain_runs(plain, speculating):
    check_n_3_outputs_equal_the_plain_runs(plain, speculating)


def test_a_json_schema_constrains_the_proposals_too(plain, speculating):
    check_a_json_schema_gives_the_plain_runs_text(plain, speculating)


def test_a_stop_id_inside_an_accepted_run_ends_it_there(plain, speculating):
    reference = generate(plain)
    stop = reference[0][0][20]  # a token of the looping text, so proposals run past it
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop])
    outputs = speculating.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    plain_outputs = plain.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for mine, theirs in zip(outputs, plain_outputs):
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert mine.outputs[0].finish_reason == theirs.outputs[0].finish_reason
    assert outputs[0].outputs[0].token_ids[-1] == stop
    assert_all_blocks_free(speculating)


def test_max_tokens_is_exact_and_accepted_tokens_carry_their_logprobs(plain, speculating):
    for max_tokens in (1, 2, 7):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert [len(o[0]) for o in generate(speculating, params)] == [max_tokens] * len(PROMPTS)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    mine = speculating.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    theirs = plain.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for a, b in zip(mine, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.outputs[0].logprobs) == len(b.outputs[0].logprobs) == 30
        for got, want in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert got.keys() == want.keys()
            for token in got:
                assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-4)


def test_a_seeded_sampled_request_gives_the_same_tokens_on_every_run(tiny_model_dir):
    """With n-gram proposals, which read the request's own tokens alone (suffix decoding's also
    read earlier requests' outputs: the same seed then verifies other proposals, and draws other
    tokens from the same distribution)."""
    llm = make_llm(tiny_model_dir, METHODS["ngram"])
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True)
    first = generate(llm, params)
    assert generate(llm, params) == first
    assert spec_stats(llm)["num_draft_tokens"] > 0
    assert_all_blocks_free(llm)
