"""The engine core on a tiny random model: plain-data steps with only the new tokens, n > 1
forking after the prompt with shared blocks, the choose hook beam search runs on, aborts of
requests and single sequences, a failing step, and the figures it reports."""

from __future__ import annotations

import msgspec
import pytest
import torch

from pagedllm.engine.core import EngineCore, StepError
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.messages import EngineCoreOutput, EngineCoreRequest
from pagedllm.sampling_params import SamplingParams
from tests.hf_logprobs import forward_logprobs

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # 10 tokens: blocks of 4 hold 4 + 4 + 2


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    torch.set_num_threads(1)
    return LLMEngine(model=str(tiny_model_dir), dtype="float32", block_size=4, num_kv_blocks=64,
                     enable_prefix_caching=False)


@pytest.fixture
def core(engine) -> EngineCore:
    assert not engine.engine_core.has_unfinished_requests()
    yield engine.engine_core
    engine.engine_core.abort_requests(engine.engine_core.unfinished_request_ids())
    assert engine.engine_core.stats().kv.num_used_blocks == 0


def request(request_id: str, prompt=PROMPT, **params) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, list(prompt), SamplingParams(**params), (), 0.0)


def run(core: EngineCore, choose=None) -> dict[tuple[str, int], EngineCoreOutput]:
    """Step until idle; each sequence's outputs merged into one (tokens joined)."""
    merged: dict[tuple[str, int], EngineCoreOutput] = {}
    while core.has_unfinished_requests():
        for out in core.step(choose).outputs:
            key = (out.request_id, out.index)
            if key in merged:
                merged[key].new_token_ids += out.new_token_ids
                merged[key].finish_reason = out.finish_reason
            else:
                merged[key] = out
    return merged


def is_plain(value) -> bool:
    if isinstance(value, (str, int, float, bool, type(None))):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(is_plain(k) and is_plain(v) for k, v in value.items())
    return False


def test_each_step_answers_with_plain_data_and_only_the_new_tokens(core, engine):
    core.add_request(request("a", max_tokens=5, temperature=0, logprobs=2))
    steps = []
    while core.has_unfinished_requests():
        steps.append(core.step())
    assert all(is_plain(msgspec.to_builtins(step)) for step in steps)  # as the channel carries it
    outputs = [o for step in steps for o in step.outputs]
    assert [len(o.new_token_ids) for o in outputs] == [1] * 5
    assert [o.finish_reason for o in outputs] == [None] * 4 + ["length"]
    assert all(len(o.new_logprobs) == 1 and o.new_logprobs[0].token_id == o.new_token_ids[0] for o in outputs)
    tokens = [t for o in outputs for t in o.new_token_ids]
    final = engine.input_processor.process("ref", PROMPT, SamplingParams(max_tokens=5, temperature=0))[1]
    engine.add_request("ref", {"prompt_token_ids": PROMPT}, final.sampling_params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            reference = out
    assert tokens == reference.outputs[0].token_ids
    stats = steps[-1].stats
    assert stats.step_num_requests == 1 and stats.num_running == 0


def test_n_outputs_fork_after_the_prompt_and_share_its_blocks(core):
    core.add_request(request("n", n=3, temperature=1.0, seed=7, max_tokens=3, ignore_eos=True))
    first = core.step()
    assert [(o.index, len(o.new_token_ids)) for o in first.outputs] == [(0, 1), (1, 1), (2, 1)]
    assert first.stats.kv.num_used_blocks == 3  # the prompt's blocks, shared three ways
    second = core.step()
    # Each writes position 10 into the shared half-full third block: two copy it, the last owns it.
    assert second.stats.step_num_used_blocks == 2 + 3
    outputs = run(core)
    assert sorted(k[1] for k in outputs) == [0, 1, 2]
    # Output i is reproducible on its own: the same as a lone request seeded with seed + i.
    for i in range(3):
        core.add_request(request(f"solo{i}", temperature=1.0, seed=7 + i, max_tokens=3, ignore_eos=True))
    solos = run(core)
    tokens = {i: [t for o in [*first.outputs, *second.outputs] if o.index == i for t in o.new_token_ids]
              for i in range(3)}
    for i in range(3):
        assert solos[(f"solo{i}", 0)].new_token_ids[:2] == tokens[i]


def test_the_choose_hook_continues_forks_and_ends_sequences(core):
    core.add_request(request("b", max_tokens=4, ignore_eos=True))
    seen_rows, seen_logits = [], {}
    plans = iter([
        {("b", 0): [10, 11, 12]},  # after the prompt: sequence 0 takes 10, forks 1 and 2
        {("b", 0): [20], ("b", 1): [], ("b", 2): [22, 23]},  # 1 ends; 2 forks 3
        {("b", 0): [30], ("b", 2): [32], ("b", 3): [33]},
        {("b", 0): [40], ("b", 2): [42], ("b", 3): [43]},  # the fourth token: max_tokens
    ])

    def choose(logits, rows):
        seen_rows.append(rows)
        for row, logit_row in zip(rows, logits):
            seen_logits.setdefault(row, []).append(logit_row.clone())
        plan = next(plans)
        return [plan[row] for row in rows]

    outputs = run(core, choose)
    assert [sorted(rows) for rows in seen_rows] == [
        [("b", 0)], [("b", 0), ("b", 1), ("b", 2)], [("b", 0), ("b", 2), ("b", 3)],
        [("b", 0), ("b", 2), ("b", 3)]]
    assert {k: (o.new_token_ids, o.finish_reason) for k, o in outputs.items()} == {
        ("b", 0): ([10, 20, 30, 40], "length"), ("b", 1): ([11], None),
        ("b", 2): ([12, 22, 32, 42], "length"), ("b", 3): ([23, 33, 43], "length")}
    # Sequence 3 read K/V it shares with 2 (copied on write): its logits are those of a fresh
    # request with its tokens.
    core.add_request(request("fresh", PROMPT + [12, 23, 33], max_tokens=1))
    fresh = []
    run(core, lambda logits, rows: fresh.append(logits[0].clone()) or [[0]])
    torch.testing.assert_close(seen_logits[("b", 3)][-1], fresh[0], rtol=0, atol=1e-4)


def test_aborting_one_sequence_or_the_whole_request_frees_its_blocks(core):
    core.add_request(request("r", n=2, temperature=1.0, max_tokens=20, ignore_eos=True))
    core.step()
    core.abort_sequences([("r", 1), ("r", 9), ("nobody", 0)])
    assert {o.index for o in core.step().outputs} == {0}
    assert core.has_unfinished_requests() and core.stats().num_running == 1
    core.abort_requests(["r", "unknown"])
    assert not core.has_unfinished_requests() and core.stats().kv.num_used_blocks == 0


def test_a_failed_step_aborts_its_requests_and_the_core_goes_on(engine):
    core = LLMEngine(model=engine.model_path, dtype="float32", block_size=4, num_kv_blocks=64,
                     max_num_seqs=1).engine_core
    core.add_request(request("a", max_tokens=3))
    core.add_request(request("b", max_tokens=3))
    real_execute = core.executor.execute

    def fail_once(out, argmax_only=False, prompt_logprobs=None):
        core.executor.execute = real_execute
        raise RuntimeError("injected")

    core.executor.execute = fail_once
    with pytest.raises(StepError) as failed:
        core.step()
    assert failed.value.request_ids == ["a"] and "injected" in str(failed.value.__cause__)
    assert core.unfinished_request_ids() == ["b"] and core.stats().kv.num_used_blocks == 0
    outputs = run(core)
    assert outputs[("b", 0)].finish_reason == "length" and len(outputs[("b", 0)].new_token_ids) == 3


def test_figures_count_tokens_and_the_prefix_hit_reaches_the_first_output(engine):
    core = LLMEngine(model=engine.model_path, dtype="float32", block_size=4, num_kv_blocks=64,
                     enable_prefix_caching=True).engine_core
    core.add_request(request("a", max_tokens=2))
    first_a = core.step().outputs[0]
    run(core)
    core.add_request(request("b", PROMPT[:8] + [99, 98], max_tokens=2))
    first_b = core.step().outputs[0]
    run(core)
    assert (first_a.num_cached_tokens, first_b.num_cached_tokens) == (0, 8)
    assert first_a.first_scheduled_time is not None
    stats = core.stats()
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (20, 4)
    assert stats.num_computed_tokens == 10 + 1 + 2 + 1  # a: prompt, decode; b: its 2 new, decode
    assert stats.kv.prefix_cache_hits == 8


def test_a_request_id_in_use_is_refused_and_nothing_is_kept(core):
    core.add_request(request("dup", max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        core.add_request(request("dup", prompt=[1], max_tokens=2))
    assert core.unfinished_request_ids() == ["dup"] and core.stats().num_prompt_tokens >= len(PROMPT)
    assert run(core)[("dup", 0)].new_token_ids.__len__() == 2


def greedy_tokens(core: EngineCore, max_tokens: int, eos=(), **params) -> list[int]:
    core.add_request(msgspec.structs.replace(
        request("g", max_tokens=max_tokens, temperature=0, **params), eos_token_ids=tuple(eos)))
    return run(core)[("g", 0)].new_token_ids


def test_every_eos_id_stops_and_min_tokens_bans_them_whatever_ignore_eos_says(core):
    free = greedy_tokens(core, 6)
    eos = tuple(dict.fromkeys(free[:3]))
    # The model's first choices are all EOS ids: before min_tokens it must take others.
    for ignore_eos in (False, True):
        banned = greedy_tokens(core, 3, eos, min_tokens=3, ignore_eos=ignore_eos)
        assert len(banned) == 3 and not set(banned) & set(eos), (ignore_eos, banned, eos)
    # Either id ends the request, once min_tokens are out.
    assert greedy_tokens(core, 6, (free[0],)) == free[:1]
    later = next(t for t in free[1:] if t != free[0])
    assert greedy_tokens(core, 6, (99999, later)) == free[:free.index(later) + 1]
    # min_tokens also bans the stop token ids.
    assert free[0] not in greedy_tokens(core, 1, stop_token_ids=[free[0]], min_tokens=1)


def test_prompt_logprobs_under_chunked_prefill_match_transformers_and_skip_the_prefix_cache(engine):
    expected = forward_logprobs(engine.model_path)(PROMPT)
    chunked = LLMEngine(model=engine.model_path, dtype="float32", block_size=4, num_kv_blocks=64,
                        max_num_batched_tokens=4, enable_prefix_caching=True).engine_core
    chunked.add_request(request("warm", max_tokens=1))  # fills the prefix cache with PROMPT
    run(chunked)
    for name in ("a", "b"):  # the second would hit the cache, but must not read it
        chunked.add_request(request(name, max_tokens=2, prompt_logprobs=3, temperature=0))
        steps = []
        while chunked.has_unfinished_requests():
            steps.append(chunked.step())
        outputs = [o for step in steps for o in step.outputs]
        assert [o.prompt_logprobs is not None for o in outputs] == [True, False]
        assert len(steps) == 3 + 1  # 10 prompt tokens in chunks of 4, then the second token
        first = outputs[0]
        assert first.num_cached_tokens == 0
        entries = first.prompt_logprobs
        assert len(entries) == len(PROMPT) and entries[0] is None
        for position, entry in enumerate(entries[1:], 1):
            row = expected[position - 1]
            assert entry.token_id == PROMPT[position]
            assert entry.logprob == pytest.approx(row[PROMPT[position]].item(), abs=1e-4)
            assert entry.rank == int((row > row[PROMPT[position]]).sum()) + 1
            assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
    assert chunked.stats().kv.num_used_blocks == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_steps_take_the_argmax_path_and_give_what_the_sampler_gives(engine, dtype):
    """A step whose rows are all plain greedy asks the model for argmax tokens alone (in bf16 on
    AMX: the packed LM head's argmax kernel); the tokens equal the full path's (logits, then the
    sampler), taken when a row asks for logprobs."""
    def run_with(logprobs):
        core = LLMEngine(model=engine.model_path, dtype=dtype, block_size=4, num_kv_blocks=256).engine_core
        calls = []
        real = core.executor.execute
        core.executor.execute = lambda out, argmax_only=False, wanted=None: (
            out.scheduled and calls.append(argmax_only)) or real(out, argmax_only, wanted)
        for i in range(3):
            core.add_request(request(f"r{i}", prompt=[5 + i, 6, 7, 8, 9], max_tokens=6, ignore_eos=True,
                                     temperature=0, logprobs=logprobs if i == 2 else None))
        tokens = {}
        while core.has_unfinished_requests():
            for o in core.step().outputs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        return tokens, calls

    fast, fast_calls = run_with(None)
    full, full_calls = run_with(2)
    assert all(fast_calls) and not any(full_calls)
    assert fast == full and all(len(t) == 6 for t in fast.values())



def test_a_request_id_with_a_hash_is_refused_as_forks_use_it(core):
    with pytest.raises(ValueError, match="'#' is kept for forks' ids"):
        core.add_request(request("a#1", max_tokens=2))
    assert not core.has_unfinished_requests()
