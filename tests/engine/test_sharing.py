"""Sharing KV blocks on the real model: prefix caching, parallel sampling, beam search."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.utils import cdiv
from tests.conftest import requires_default_model

pytestmark = requires_default_model

SYSTEM = ("You are a careful assistant. Answer briefly and truthfully, and say so when you do "
          "not know. Use plain words. ") * 3
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?",
             "Which planet is largest?"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def make_llm(**kwargs) -> LLM:
    options = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=512, block_size=16)
    options.update(kwargs)
    return LLM(**options)


@pytest.fixture(scope="module")
def cached() -> LLM:
    return make_llm(enable_prefix_caching=True)


@pytest.fixture(scope="module")
def uncached() -> LLM:
    return make_llm(enable_prefix_caching=False)


def texts(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_prefix_caching_changes_no_output_cold_or_warm(cached, uncached):
    prompts = [SYSTEM + q for q in QUESTIONS]
    reference = texts(uncached, prompts)
    cold = texts(cached, prompts[:1])  # fills the cache with the shared system prompt
    warm = texts(cached, prompts)  # every request hits it now
    assert cold == reference[:1]
    assert warm == reference
    stats = cached.memory_stats()
    assert stats["prefix_cache_hits"] > 0
    assert stats["num_used_blocks"] == 0  # finished requests' blocks are cached-but-free


def test_warm_request_computes_only_the_uncached_tail(cached):
    prompt = SYSTEM + QUESTIONS[0]
    texts(cached, [prompt])
    before = cached.memory_stats()
    texts(cached, [prompt])
    after = cached.memory_stats()
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    prompt_len = len(cached.get_tokenizer().encode(prompt))
    # all full blocks but the last token's are reused; at least one token is computed
    assert hits == (prompt_len - 1) // 16 * 16


def test_cache_salt_keeps_tenants_apart(cached):
    engine = cached.engine
    prompt = SYSTEM + QUESTIONS[1]
    texts(cached, [prompt])
    before = engine.memory_stats()["prefix_cache_hits"]
    engine.add_request("salted", prompt, GREEDY, cache_salt="tenant-b")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.memory_stats()["prefix_cache_hits"] == before


def test_memory_pressure_evicts_cached_blocks_without_leaks(uncached):
    """Eight distinct prompts whose full blocks (48) outnumber the cache's 40: eight of them are
    evicted on the way, every output is still right, and at the end every block is free and
    holds a cached full block (none leaked, none left half-written or unhashed)."""
    small = make_llm(enable_prefix_caching=True, num_kv_blocks=40, max_model_len=256)
    prompts = [f"Story number {i}: " + SYSTEM for i in range(8)]  # all distinct from the first block
    computed = [len(small.get_tokenizer().encode(p)) + 15 for p in prompts]  # the last token is not
    assert all(n % 16 == 0 for n in computed), computed  # whole blocks only: each one is cached
    assert sum(n // 16 for n in computed) > 40  # more than the cache holds: eviction must happen
    out = small.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == texts(uncached, prompts)
    assert all(len(o.outputs[0].token_ids) == 16 for o in out)
    stats = small.memory_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] == 40
    assert stats["num_used_blocks"] == 0
    assert stats["num_cached_free_blocks"] == 40


def test_eviction_takes_the_least_recently_used_blocks_tail_first():
    """A's blocks stay cached when it finishes; B then needs exactly two more blocks than are
    free without a hash: A's last two cached blocks go, and A's prompt hits only the rest."""
    llm = make_llm(enable_prefix_caching=True, num_kv_blocks=16, max_model_len=256)
    a = llm.get_tokenizer().encode("Story number 0: " + SYSTEM)
    texts(llm, [{"prompt_token_ids": a}])
    cached_a = (len(a) + 15) // 16  # full blocks of its prompt and 15 computed outputs
    assert llm.memory_stats()["num_cached_free_blocks"] == cached_a
    evicted = 2
    b = [(7 * i) % 1000 + 10 for i in range(16 * (16 - cached_a + evicted) - 15)]  # distinct from a
    texts(llm, [{"prompt_token_ids": b}])  # takes (len(b) + 15) / 16 blocks
    before = llm.memory_stats()["prefix_cache_hits"]
    texts(llm, [{"prompt_token_ids": a}])
    kept = min(cached_a - evicted, (len(a) - 1) // 16)
    assert llm.memory_stats()["prefix_cache_hits"] - before == kept * 16
    assert 0 < kept * 16 < (len(a) - 1) // 16 * 16  # a partial hit: without eviction, all of it
    stats = llm.memory_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_used_blocks"] == 0


def test_parallel_sampling_shares_the_prompt_blocks():
    llm = make_llm(enable_prefix_caching=False)
    engine = llm.engine
    prompt = SYSTEM + QUESTIONS[2]
    num_prompt = len(llm.get_tokenizer().encode(prompt))
    params = SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=1, ignore_eos=True)
    engine.add_request("fan", prompt, params)
    peak_shared = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak_shared = max(peak_shared, engine.stats().step_num_used_blocks)
    for i in range(4):
        engine.add_request(f"solo-{i}", prompt, SamplingParams(temperature=1.0, max_tokens=8,
                                                               seed=i, ignore_eos=True))
    peak_separate = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak_separate = max(peak_separate, engine.stats().step_num_used_blocks)
    # Each sequence computes the prompt and 7 of its 8 tokens. Shared: the prompt's full blocks
    # once, and each output's own blocks from the one it first writes into (copied on write).
    own_blocks = cdiv(num_prompt + 7, 16) - num_prompt // 16
    assert peak_shared == num_prompt // 16 + 4 * own_blocks
    assert peak_separate == 4 * cdiv(num_prompt + 7, 16)
    assert peak_shared < peak_separate
    assert engine.memory_stats()["num_used_blocks"] == 0


def test_parallel_sampling_children_match_their_own_seeded_runs():
    """Output i of n is reproducible: the same as its shared-prefix run, block by block."""
    llm = make_llm(enable_prefix_caching=False)
    params = SamplingParams(n=3, temperature=0.8, max_tokens=10, seed=7, ignore_eos=True)
    first = llm.generate(SYSTEM, params, use_tqdm=False)[0]
    again = llm.generate([QUESTIONS[0], SYSTEM], [SamplingParams(max_tokens=5), params],
                         use_tqdm=False)[1]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]


def naive_beam_search(model, prompt: list[int], width: int, steps: int) -> list[list[int]]:
    """The same algorithm recomputing every beam from scratch with a dense forward: no
    paging, no sharing. Returns generated token lists, best first (no EOS in these runs)."""
    from tests.engine.test_llm_engine import _dense_logits

    beams = [([], 0.0)]
    for _ in range(steps):
        candidates = []
        for tokens, cum in beams:
            logp = torch.log_softmax(_dense_logits(model, torch.tensor(prompt + tokens)), -1)
            values, ids = logp.topk(2 * width)
            candidates += [(cum + v, tokens + [t]) for v, t in zip(values.tolist(), ids.tolist())]
        candidates.sort(key=lambda c: -c[0])
        beams = [(tokens, cum) for cum, tokens in candidates[:width]]
    return [tokens for tokens, _ in beams]


def test_beam_search_equals_a_dense_reference_and_frees_blocks(default_model):
    llm = make_llm(enable_prefix_caching=False, block_size=4)
    prompt = llm.get_tokenizer().encode("The best way to learn a language is")
    result = llm.beam_search([{"prompt_token_ids": prompt}], beam_width=3, max_tokens=6,
                             length_penalty=0.0)[0]
    expected = naive_beam_search(default_model.model, prompt, 3, 6)
    assert [s.token_ids for s in result.sequences] == expected
    stats = llm.memory_stats()
    assert stats["num_used_blocks"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
