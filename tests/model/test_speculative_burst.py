"""n-gram speculation inside a decode burst's compiled call (pagedllm.engine.decode_burst,
csrc/decode_burst.cpp): the greedy tokens, texts and finish reasons of plain decode steps and of
speculative steps without bursts, for 1, 2 and 4 streams ending at different steps (4 streams'
proposals cut to fit the call's rows), stops inside a burst, every block free after; the proposals
counted in the speculation's metrics, each burst step's count of kept tokens agreeing with the
tokens it made; through prefix-cache hits, preemption and n = 3; and a burst the call cannot take
(its loop) still giving the tokens."""

from __future__ import annotations

import gguf
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.model.decode_layers import BurstSpeculation
from tests.engine.test_llm_engine import assert_all_blocks_free
from tests.model.test_decode_burst_call import _dense_gguf
from tests.model.test_decode_layers import tier_runs_it

Q = gguf.GGMLQuantizationType
# Prompts that repeat themselves, so the n-gram rule finds matches (a random model's greedy text
# falls into loops too).
PROMPTS = [[5, 9, 20, 5, 9, 20, 5, 9, 20, 33], [77, 1, 250, 77, 1], [12] * 19, [40, 41, 42, 43] * 3]
MAX_TOKENS = [41, 23, 30, 9]
SPEC = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
WRITERS = {
    "untied, plain table": lambda t: _dense_gguf(t, "llama_gqa_untied", None, Q.Q8_0),
    "tied, quantized table": lambda t: _dense_gguf(t, "qwen3_qk_norm", Q.Q8_0, None),
}


def _llm(path: str, burst: int, speculative_config=SPEC, **overrides) -> LLM:
    settings = dict(dtype="float32", block_size=4, num_kv_blocks=256, max_model_len=128,
                    enable_prefix_caching=False, decode_burst=burst, speculative_config=speculative_config)
    return LLM(path, **{**settings, **overrides})


def _outputs(llm: LLM, **params) -> list:
    """Each stream's tokens, text and finish reason, for 1, 2 and 4 streams at once."""
    out = []
    for count in (1, 2, 4):
        sampling = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, **params)
                    for m in MAX_TOKENS[:count]]
        results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:count]], sampling, use_tqdm=False)
        out.append([(o.token_ids, o.text, o.finish_reason) for r in results for o in r.outputs])
    return out


@pytest.fixture(params=list(WRITERS))
def model_path(request, tmp_path) -> str:
    return WRITERS[request.param](tmp_path)


def test_speculative_bursts_give_the_plain_tokens(tier, model_path):
    llm = _llm(model_path, 5)
    core = llm.engine.engine_core
    if not tier_runs_it():
        assert not core.executor.speculates_in_bursts
        return
    fused = core.executor.runner.model.decode_layers
    calls = []
    burst = fused.burst

    def counted(first_ids, counts, context, meta, speculation=None, max_steps=0):
        tokens, steps = burst(first_ids, counts, context, meta, speculation, max_steps)
        calls.append((speculation, max_steps, tokens, steps))
        return tokens, steps

    fused.burst = counted
    outputs = _outputs(llm)
    assert outputs == _outputs(_llm(model_path, 1))  # a speculative step per engine step
    assert outputs == _outputs(_llm(model_path, 1, None))  # a plain decode step per engine step
    assert_all_blocks_free(llm)
    assert calls and all(speculation is not None and max_steps == 5 for speculation, max_steps, _, _ in calls)
    for speculation, _, tokens, steps in calls:
        assert len(steps) <= 5 * len(tokens)
        for row, made in enumerate(tokens):  # each step made its kept proposals and one more
            assert sum(kept + 1 for r, _, kept in steps if r == row) == len(made)
            assert all(kept <= proposed <= speculation.ks[row] for r, proposed, kept in steps if r == row)
    four_streams = [s for s, _, tokens, _ in calls if len(tokens) == 4]
    assert four_streams and all(sum(s.ks) + 4 <= fused.max_burst_rows for s in four_streams)
    stats = core.speculator.stats
    proposed = sum(p for *_, steps in calls for _, p, _ in steps)
    kept = sum(k for *_, steps in calls for _, p, k in steps if p)
    assert stats.num_draft_tokens == proposed > 0 and stats.num_accepted_tokens == kept > 0
    assert stats.num_drafts == sum(1 for *_, steps in calls for _, p, _ in steps if p)


def test_fewer_engine_steps_than_speculative_steps(tier, model_path):
    if not tier_runs_it():
        return
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    steps = {}
    for burst in (1, 5):
        llm = _llm(model_path, burst)
        llm.engine.add_request("counted", {"prompt_token_ids": PROMPTS[0]}, params)
        steps[burst] = 0
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
            steps[burst] += 1
        assert llm.engine.engine_core.speculator.stats.num_drafts > 0
    assert steps[5] < steps[1]


def test_stops_inside_a_speculative_burst(tier, model_path):
    if not tier_runs_it():
        return
    plain = _llm(model_path, 1, None)
    tokens = _outputs(plain)[0][0][0]
    stop = next(t for i, t in enumerate(tokens) if i >= 7 and t not in tokens[:i])
    llm = _llm(model_path, 5)
    assert _outputs(llm, stop_token_ids=[stop]) == _outputs(plain, stop_token_ids=[stop])
    assert_all_blocks_free(llm)


def test_prefix_hits_preemption_and_n_3(tier, model_path):
    if not tier_runs_it():
        return
    plain = _outputs(_llm(model_path, 1, None))
    cached = _llm(model_path, 5, enable_prefix_caching=True)
    assert _outputs(cached) == _outputs(cached) == plain
    assert cached.memory_stats()["prefix_cache_hits"] > 0
    tight = _llm(model_path, 5, num_kv_blocks=26, max_model_len=64)  # 39 blocks at the streams' ends
    assert _outputs(tight) == plain
    assert tight.memory_stats()["num_preemptions"] > 0
    n_3 = SamplingParams(n=3, temperature=0, max_tokens=30, ignore_eos=True)
    outputs = {}
    for burst, spec in ((5, SPEC), (1, None)):
        llm = _llm(model_path, burst, spec)
        result = llm.generate([{"prompt_token_ids": PROMPTS[0]}], n_3, use_tqdm=False)[0]
        outputs[burst] = [o.token_ids for o in result.outputs]
        assert_all_blocks_free(llm)
    assert outputs[5] == outputs[1] and len(outputs[5]) == 3
    for llm in (cached, tight):
        assert llm.engine.engine_core.speculator.stats.num_drafts > 0
        assert_all_blocks_free(llm)


def test_a_burst_the_call_cannot_take_makes_its_tokens_without_proposals(tier, model_path):
    """Its loop in Python (where DecodeLayers.bursts says no at run time: a rope past its length
    limit, more sequences than the call's rows): 5 plain decode steps a burst."""
    if not tier_runs_it():
        return
    llm = _llm(model_path, 5)
    fused = llm.engine.engine_core.executor.runner.model.decode_layers
    fused.bursts = lambda *args: False
    assert _outputs(llm) == _outputs(_llm(model_path, 1, None))
    assert llm.engine.engine_core.speculator.stats.num_drafts == 0
    assert_all_blocks_free(llm)
    params = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    llm.engine.add_request("counted", {"prompt_token_ids": PROMPTS[0]}, params)
    steps = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        steps += 1
    assert steps == 1 + 3  # the prompt's step, then 12 tokens in steps of at most 5


def test_proposals_are_cut_to_fit_the_rows():
    speculation = BurstSpeculation([], [6, 2, 6, 0], 1, 3)
    assert speculation.within(100).ks == [6, 2, 6, 0]
    assert speculation.within(12).ks == [3, 2, 3, 0]  # the largest first: 3 + 2 + 3 + 0 + 4 rows
    assert speculation.within(4).ks == [0, 0, 0, 0]
