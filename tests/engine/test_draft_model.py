"""Speculative decoding with a draft model (pagedllm.spec_decode.draft) on tiny random models in
float32: greedy tokens equal the target's plain run's, through preemption, prefix-cache hits and
n = 3; the draft's K/V lives in the request's own blocks, all back in the pool at the end; seeded
sampled requests repeat; a draft that cannot propose to the target is refused at start.

Drafts: a smaller random model (1 layer, half the width) of the target's vocabulary, which
proposes but is almost never right; the target with 10% noise on its weights, right about a
quarter of the time (so both the accepted and the rejected paths run); the target itself, from a
GGUF file, right every time.
"""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import AddedToken

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.spec_decode import MAX_SPECULATIVE_TOKENS
from tests.engine.test_speculation import (
    PROMPTS,
    assert_all_blocks_free,
    assert_both_paths_ran,
    generate,
    spec_stats,
)
from tests.model.tiny import make_hf_model, save_checkpoint, tokenizer_backend, write_gguf

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> dict:
    """name -> the draft's path; "target" the target itself as a GGUF file."""
    root = tmp_path_factory.mktemp("drafts")
    small = make_hf_model("llama_gqa_untied", seed=1, num_hidden_layers=1, hidden_size=32,
                          intermediate_size=48, num_attention_heads=2, num_key_value_heads=1)
    near = make_hf_model("llama_gqa_untied")  # the tiny_model_dir fixture's weights (seed 0)
    write_gguf(near, root / "target.gguf")
    noise = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for weight in near.parameters():
            weight.add_(torch.randn(weight.shape, generator=noise) * 0.1 * weight.std())
    return {"small": save_checkpoint(small, root / "small"), "near": save_checkpoint(near, root / "near"),
            "target": root / "target.gguf"}


def spec(path, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


def make_llm(model, draft=None, **overrides) -> LLM:
    torch.set_num_threads(1)
    settings = dict(model=str(model), dtype="float32", block_size=4, num_kv_blocks=256,
                    max_model_len=256, enable_prefix_caching=False)
    return LLM(**{**settings, **overrides}, speculative_config=None if draft is None else spec(draft))


@pytest.fixture(scope="module")
def plain(tiny_model_dir) -> LLM:
    return make_llm(tiny_model_dir)


@pytest.fixture(scope="module")
def near(tiny_model_dir, drafts) -> LLM:
    return make_llm(tiny_model_dir, drafts["near"])


def test_a_small_random_draft_gives_the_targets_greedy_tokens(plain, tiny_model_dir, drafts):
    llm = make_llm(tiny_model_dir, drafts["small"])
    assert generate(llm, GREEDY) == generate(plain, GREEDY)
    assert spec_stats(llm)["num_draft_tokens"] > 0
    assert_all_blocks_free(llm)


def test_a_near_draft_is_accepted_in_part_and_changes_no_token(plain, near):
    assert generate(near, GREEDY) == generate(plain, GREEDY)
    assert_both_paths_ran(near)
    assert_all_blocks_free(near)


def test_the_target_as_its_own_draft_has_every_proposal_accepted(drafts):
    """Shows the draft really runs: its K/V and tokens as the target's, greedy and sampled
    (q equals p, so min(1, p / q) accepts: up to float32 rounding between the two batches)."""
    gguf = drafts["target"]
    llm, plain = make_llm(gguf, gguf), make_llm(gguf)
    assert generate(llm, GREEDY) == generate(plain, GREEDY)
    stats = spec_stats(llm)
    assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 2 * stats["num_drafts"] > 0
    generate(llm, SamplingParams(temperature=0.8, seed=1, max_tokens=30, ignore_eos=True))
    after = spec_stats(llm)
    num_proposed = after["num_draft_tokens"] - stats["num_draft_tokens"]
    assert after["num_accepted_tokens"] - stats["num_accepted_tokens"] == num_proposed > 0
    assert_all_blocks_free(llm)


def test_the_drafts_kv_stays_exact_through_preemption_prefix_hits_and_forks(drafts):
    """With the target as its draft, a single stale or missing draft K/V entry would show as a
    rejected proposal: none is, though requests are preempted (their blocks gone), hit the
    prefix cache (blocks whose draft layers another request wrote, or nobody) and fork n = 3
    (copy-on-write of a shared tail, in the draft's tensors too)."""
    gguf = drafts["target"]
    llm = make_llm(gguf, gguf, num_kv_blocks=24, max_model_len=64, enable_prefix_caching=True,
                   max_num_batched_tokens=16)  # the draft catches up on a prompt in chunks too
    prompts = PROMPTS[:2] + PROMPTS[3:] + [p[:6] for p in PROMPTS]
    params = SamplingParams(n=3, temperature=0, max_tokens=30, ignore_eos=True)
    want = generate(make_llm(gguf), params, prompts)
    assert generate(llm, params, prompts) == want
    assert generate(llm, params, prompts) == want
    stats = llm.memory_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0
    assert_all_blocks_free(llm)


def test_greedy_tokens_survive_preemption_under_a_tight_budget(plain, tiny_model_dir, drafts):
    tight = make_llm(tiny_model_dir, drafts["near"], num_kv_blocks=24, max_model_len=64)
    prompts = PROMPTS[:2] + PROMPTS[3:] + [p[:6] for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)
    assert generate(tight, params, prompts) == generate(plain, params, prompts)
    assert tight.memory_stats()["num_preemptions"] > 0
    assert_both_paths_ran(tight)
    assert_all_blocks_free(tight)


def test_prefix_cache_hits_change_nothing(plain, tiny_model_dir, drafts):
    cached = make_llm(tiny_model_dir, drafts["near"], enable_prefix_caching=True)
    first = generate(cached, GREEDY)
    again = generate(cached, GREEDY)
    assert cached.memory_stats()["prefix_cache_hits"] > 0
    assert first == again == generate(plain, GREEDY)
    assert_both_paths_ran(cached)
    assert_all_blocks_free(cached)


def test_n_3_outputs_each_equal_the_plain_runs(plain, near):
    params = SamplingParams(n=3, temperature=0, max_tokens=30, ignore_eos=True)
    got = generate(near, params)
    assert got == generate(plain, params)
    assert all(len(outputs) == 3 for outputs in got)
    assert_all_blocks_free(near)


def test_a_json_schema_cuts_the_drafts_proposals(plain, near):
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 12}}, "required": ["a"]}
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": schema})
    prompts = ["hello hello hello", "abc abc abc abc"]
    want = [o.outputs[0].text for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].text for o in near.generate(prompts, params, use_tqdm=False)]
    assert got == want
    for text in got:
        json.loads(text)
    assert_all_blocks_free(near)


def test_a_constrained_draft_proposes_under_the_grammar(drafts):
    """With the target as its draft, the draft's masked choice is the target's: proposals stay
    whole and are all accepted (an unmasked draft's are mostly cut at its first refused token)."""
    gguf = drafts["target"]
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 12}}, "required": ["a"]}
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": schema})
    prompts = ["hello hello hello", "abc abc abc abc"]
    llm = make_llm(gguf, gguf)
    got = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].text for o in make_llm(gguf).generate(prompts, params, use_tqdm=False)]
    stats = spec_stats(llm)
    assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 2 * stats["num_drafts"] > 0
    assert_all_blocks_free(llm)


def test_the_draft_writes_only_into_the_requests_own_blocks(near):
    """Every draft pass's block table is the KV manager's live list for that request, and its
    positions fall inside it; the KV plan counts both models' bytes in each block; afterwards the
    draft's table holds no row and every block is free."""
    core = near.engine.engine_core
    runner = core.speculator.draft.runner
    passes = []
    execute = runner.execute

    def checked(scheduled, argmax_only=False):
        for s in scheduled:
            request = core.scheduler.get_request(s.request.request_id)
            held = core.kv_manager.block_ids(request)
            assert s.block_ids == held
            assert s.num_computed_tokens + s.num_new_tokens <= len(held) * runner.block_size
            passes.append(s.num_new_tokens)
        return execute(scheduled, argmax_only)

    runner.execute = checked
    try:
        generate(near, GREEDY)
    finally:
        del runner.execute
    assert passes and max(passes) > 1  # catch-up chunks and one-token proposal passes
    assert runner.block_table.num_live == 0
    stats = near.memory_stats()
    # The near draft has the target's shape: half of each block's bytes are its K/V.
    assert stats["kv_cache_bytes"] == stats["num_blocks"] * 2 * stats["draft_kv_bytes_per_block"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"] == 256


def test_an_aborted_request_takes_its_draft_kv_with_it(near):
    """Aborted while speculating: its blocks (the draft's K/V among them) all go back, and the
    draft's table forgets it."""
    engine, core = near.engine, near.engine.engine_core
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": prompt}, GREEDY)
    drafted = spec_stats(near)["num_draft_tokens"]
    for _ in range(6):
        engine.step()
    assert spec_stats(near)["num_draft_tokens"] > drafted
    assert core.speculator.draft.runner.block_table.num_live == 3
    assert near.memory_stats()["num_free_blocks"] < near.memory_stats()["num_blocks"]
    for i in range(3):
        engine.abort_request(f"abort-{i}")
    assert core.speculator.draft.runner.block_table.num_live == 0
    assert not core.speculator.draft._computed
    assert_all_blocks_free(near)


def test_a_seeded_sampled_request_gives_the_same_tokens_on_every_run(near):
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True)
    before = spec_stats(near)["num_accepted_tokens"]
    first = generate(near, params)
    assert generate(near, params) == first
    assert spec_stats(near)["num_accepted_tokens"] > before
    assert_all_blocks_free(near)


def test_an_unfit_draft_is_refused_at_start(tiny_model_dir, drafts, tmp_path):
    def refused(draft_config: dict, match: str) -> None:
        with pytest.raises(ValueError, match=match) as error:
            LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, speculative_config=draft_config)
        assert "\n" not in str(error.value)

    refused(spec(tmp_path / "missing"), "does not exist")
    refused(spec(drafts["small"], k=0), "num_speculative_tokens must be an integer from 1")
    refused(spec(drafts["small"], k=MAX_SPECULATIVE_TOKENS + 1), "num_speculative_tokens must be")
    wider = save_checkpoint(make_hf_model("llama_gqa_untied", vocab_size=320), tmp_path / "wider")
    refused(spec(wider), "the draft model has 320 logits, the target 300")
    other = save_checkpoint(make_hf_model("llama_gqa_untied"), tmp_path / "other")
    backend = tokenizer_backend()
    backend.add_special_tokens([AddedToken("<|pad|>", special=True, normalized=False)])
    backend.save(str(other / "tokenizer.json"))
    refused(spec(other), "the draft's tokenizer differs from the target's")
    refused(spec(drafts["target"]), "the draft's tokenizer differs")  # the GGUF's has <unused> ids
    with pytest.raises(ValueError, match="runs on one process"):
        EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2,
                     speculative_config=spec(drafts["small"]))
