"""The engine on compressed KV pages (int8, fp8).

Each token's K/V is quantized by itself, so nothing about paging may change an output: greedy
tokens are the same whatever else is in the batch, whatever the block size, with or without
preemption, prefix-cache hits, copy-on-write forks, beam search and the contiguous layout. These
run on a tiny random Llama in float32 (fast, and its large random weights make any change to a
K/V value show in the tokens); the default model checks that compressed pages still answer.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.conftest import requires_default_model
from tests.engine.test_llm_engine import assert_all_blocks_free, greedy_ids

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a village,",
           "The three primary colors are", "Water boils at", "import numpy as np"]
SYSTEM = "You are a careful assistant. Answer briefly. "


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.model.tiny import make_hf_model, save_checkpoint

    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's matmuls are too small to share between threads
    yield save_checkpoint(make_hf_model("llama_gqa_untied"), tmp_path_factory.mktemp("tiny"))
    torch.set_num_threads(previous)


@pytest.fixture(scope="module", params=["int8", "fp8", "fp8_e5m2"])
def kv_cache_dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def make_llm(tiny_model, kv_cache_dtype):
    def make(**kwargs) -> LLM:
        options = dict(model=str(tiny_model), dtype="float32", num_kv_blocks=96, max_model_len=96,
                       block_size=4, kv_cache_dtype=kv_cache_dtype)
        return LLM(**{**options, **kwargs})
    return make


@pytest.fixture(scope="module")
def llm(make_llm) -> LLM:
    return make_llm()


def test_memory_stats_report_the_kv_dtype_and_proportionally_more_blocks(make_llm, kv_cache_dtype):
    compressed = make_llm(num_kv_blocks=None, kv_cache_memory="1MiB").memory_stats()
    plain = make_llm(num_kv_blocks=None, kv_cache_memory="1MiB", kv_cache_dtype="auto").memory_stats()
    assert compressed["kv_cache_dtype"] == {"fp8": "fp8_e4m3"}.get(kv_cache_dtype, kv_cache_dtype)
    assert plain["kv_cache_dtype"] == "float32"
    # head_dim 16: a token's head is 16 one-byte codes and a 2-byte scale against 64 bytes.
    assert compressed["bytes_per_block"] * 64 == plain["bytes_per_block"] * 18
    assert compressed["num_blocks"] == 2**20 // compressed["bytes_per_block"]
    assert compressed["num_blocks"] >= 3.5 * plain["num_blocks"]


def test_greedy_is_the_same_alone_and_in_a_batch(llm):
    alone = greedy_ids(llm, [PROMPTS[2]], GREEDY)[0]
    others = [f"{p} ({i})" for i, p in enumerate(PROMPTS)]
    assert greedy_ids(llm, others[:3] + [PROMPTS[2]] + others[3:], GREEDY)[3] == alone
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_is_the_same_for_every_block_size(llm, make_llm, block_size):
    other = make_llm(block_size=block_size, num_kv_blocks=4 * 96 // block_size)
    assert greedy_ids(other, PROMPTS, GREEDY) == greedy_ids(llm, PROMPTS, GREEDY)


def test_greedy_is_the_same_when_preemption_recomputes(llm, make_llm):
    prompts = [p + " " + p for p in PROMPTS]
    tight = make_llm(num_kv_blocks=24, enable_prefix_caching=False)
    assert greedy_ids(tight, prompts, GREEDY) == greedy_ids(llm, prompts, GREEDY)
    assert tight.memory_stats()["num_preemptions"] > 0
    assert_all_blocks_free(tight)


def test_contiguous_layout_gives_the_same_tokens(llm, make_llm):
    contiguous = make_llm(kv_layout="contiguous", num_kv_blocks=96 * 4)
    assert greedy_ids(contiguous, PROMPTS, GREEDY) == greedy_ids(llm, PROMPTS, GREEDY)


def test_prefix_cache_hits_on_compressed_blocks_change_nothing(llm, make_llm):
    prompts = [SYSTEM + p for p in PROMPTS[:3]]
    reference = greedy_ids(make_llm(enable_prefix_caching=False), prompts, GREEDY)
    before = llm.memory_stats()["prefix_cache_hits"]
    greedy_ids(llm, prompts[:1], GREEDY)  # caches the system prompt's blocks
    assert greedy_ids(llm, prompts, GREEDY) == reference
    assert llm.memory_stats()["prefix_cache_hits"] > before


def test_forked_outputs_copy_compressed_blocks_on_write(make_llm):
    """n=3 shares the prompt's blocks, its partial last block included; each output's first
    write into that block copies it (codes and scales). Output i must equal its own unshared run."""
    llm = make_llm(enable_prefix_caching=False)
    prompt = {"prompt_token_ids": list(range(1, 47))}  # 46 tokens: the last block of 4 is partial
    params = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=7, ignore_eos=True)
    shared = llm.generate(prompt, params, use_tqdm=False)[0]
    alone = [llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=10, seed=7 + i,
                                                 ignore_eos=True), use_tqdm=False)[0]
             for i in range(3)]
    assert [o.token_ids for o in shared.outputs] == [a.outputs[0].token_ids for a in alone]
    assert len({tuple(o.token_ids) for o in shared.outputs}) > 1  # the outputs did diverge
    assert_all_blocks_free(llm)


def test_beam_search_does_not_depend_on_the_block_size(make_llm):
    prompt = list(b"The best way to learn a language is")
    results = []
    for block_size in (1, 4):
        beams = make_llm(block_size=block_size, num_kv_blocks=4 * 96 // block_size,
                         enable_prefix_caching=False)
        results.append([s.token_ids for s in beams.beam_search(
            [{"prompt_token_ids": prompt}], beam_width=3, max_tokens=6, length_penalty=0.0)[0].sequences])
        assert_all_blocks_free(beams)
    assert results[0] == results[1]


@requires_default_model
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_the_default_model_still_knows_paris(name):
    llm = LLM(kv_cache_dtype=name, kv_cache_memory="16MiB", max_model_len=128)
    text = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)[0].outputs[0].text
    assert "Paris" in text
