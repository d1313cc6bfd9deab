import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pagedllm.core.request import Request
from pagedllm.kernels import sampling, tiers
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampler import Sampler, SamplingRow, TokenRules, sampling_probs


def row(params: SamplingParams, prompt=(1, 2), output=(), stops=(), seed=None,
        bad_words=()) -> SamplingRow:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    history = Request("r", list(prompt), params)
    for token in output:
        history.append_token(token)
    rules = TokenRules.build(params, tuple(map(tuple, bad_words)), torch.device("cpu"))
    return SamplingRow(params, history, tuple(stops), generator, rules)


def test_greedy_takes_argmax():
    logits = torch.randn(4, 100)
    out = Sampler()(logits, [row(SamplingParams(temperature=0))] * 4)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_seeded_sample_is_the_same_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(1, 500)
    alone = Sampler(seed=1)(logits, [row(SamplingParams(temperature=1.0), seed=7)]).token_ids[0]
    others = torch.randn(5, 500)
    batch = torch.cat([others[:2], logits, others[2:]])
    rows = [row(SamplingParams(temperature=1.0)) for _ in range(5)]
    rows.insert(2, row(SamplingParams(temperature=1.0), seed=7))
    in_batch = Sampler(seed=99)(batch, rows).token_ids[2]
    assert in_batch == alone


def test_samples_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    sampler = Sampler(seed=3)
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[sampler(logits, [row(SamplingParams(temperature=1.0))]).token_ids[0]] += 1
    assert abs(counts[0] / 3000 - 0.7) < 0.04
    assert abs(counts[2] / 3000 - 0.1) < 0.03


def test_top_k_one_is_greedy():
    logits = torch.randn(8, 300)
    rows = [row(SamplingParams(temperature=1.5, top_k=1)) for _ in range(8)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("top_p", [1e-46, 5e-324, 1e-12])
def test_a_tiny_top_p_keeps_the_top_token(top_p):
    """float32 rounds 1e-46 to 0: the threshold must still keep the most likely token."""
    logits = torch.randn(8, 300)
    rows = [row(SamplingParams(temperature=1.5, top_p=top_p)) for _ in range(8)]
    assert Sampler(seed=0)(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(seed=0)
    seen = {sampler(logits, [row(SamplingParams(top_p=0.75))]).token_ids[0] for _ in range(400)}
    assert seen == {0, 1}  # 0.5 + 0.3 reaches 0.75; tokens 2 and 3 are cut


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    sampler = Sampler(seed=0)
    seen = {sampler(logits, [row(SamplingParams(min_p=0.2))]).token_ids[0] for _ in range(400)}
    assert seen == {0, 1}  # 0.05 < 0.2 * 0.6


def test_repetition_penalty_pushes_seen_tokens_down():
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    out = Sampler()(logits, [row(SamplingParams(temperature=0, repetition_penalty=1.5), prompt=[0])])
    assert out.token_ids == [1]  # 2.0 / 1.5 < 1.9


@pytest.mark.parametrize("penalty", [5e-324, 1e-300, 1e-40])
def test_a_repetition_penalty_near_zero_keeps_the_row_finite(penalty):
    """Seen tokens' logits pushed past float32 (or a penalty that is 0 in float32) stay finite:
    the draw is among the seen tokens, never from a NaN row (which gave ids past the vocabulary)."""
    logits = torch.tensor([[2.0, 1.9, -1.0, float("-inf"), 0.5]] * 8)
    params = SamplingParams(temperature=1.0, repetition_penalty=penalty, seed=3)
    out = Sampler()(logits, [row(params, prompt=[0, 1, 3]) for _ in range(8)])
    assert set(out.token_ids) <= {0, 1}


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    params = SamplingParams(temperature=0, frequency_penalty=0.3, presence_penalty=0.0)
    # token 0 was generated twice: 3.0 - 0.6 = 2.4 < 2.5
    assert Sampler()(logits, [row(params, prompt=[1, 1, 1], output=[0, 0])]).token_ids == [1]
    # seen only in the prompt: no penalty
    assert Sampler()(logits, [row(params, prompt=[0, 0, 0])]).token_ids == [0]


def test_min_tokens_bans_stop_ids_until_reached():
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0, min_tokens=2)
    assert Sampler()(logits, [row(params, output=[1], stops=[0])]).token_ids == [1]
    assert Sampler()(logits, [row(params, output=[1, 1], stops=[0])]).token_ids == [0]


def test_min_tokens_never_leaves_a_row_with_nothing_to_draw():
    """A grammar that allows only a stop token (its -inf mask on the rest) wins over the ban."""
    inf = float("-inf")
    logits = torch.tensor([[inf, 2.0, inf], [inf, 2.0, 1.0]])
    for temperature in (0, 1.0):
        params = SamplingParams(temperature=temperature, min_tokens=3)
        rows = [row(params, stops=[1]), row(params, stops=[1], seed=0)]
        assert Sampler()(logits, rows).token_ids == [1, 2]


def test_logprobs_are_log_softmax_of_the_raw_logits():
    torch.manual_seed(1)
    logits = torch.randn(2, 50)
    rows = [row(SamplingParams(temperature=0, logprobs=5)), row(SamplingParams(temperature=0.8, logprobs=2))]
    out = Sampler()(logits, rows)
    expected = torch.log_softmax(logits, -1)
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[i]
        assert math.isclose(lp.logprob, expected[i, lp.token_id].item(), abs_tol=1e-5)
        top_ids = expected[i].topk(len(lp.top)).indices.tolist()
        assert [t for t, _ in lp.top] == top_ids
        assert lp.rank == int((expected[i] > expected[i, lp.token_id]).sum()) + 1
    assert out.logprobs[0].rank == 1


def test_pinned_logprob_token_ids_give_those_tokens_whatever_their_rank():
    """vLLM's logprob_token_ids: the alternatives are the given tokens, valued from the raw logits
    (before allowed_token_ids masks them) with their true ranks; other rows keep their top-n."""
    torch.manual_seed(3)
    logits = torch.randn(2, 50)
    expected = torch.log_softmax(logits, -1)
    pinned = [int(expected[0].argmin()), 7, int(expected[0].argmax())]
    rows = [row(SamplingParams(temperature=0, logprobs=5, logprob_token_ids=pinned, allowed_token_ids=[3])),
            row(SamplingParams(temperature=0, logprobs=2))]
    out = Sampler()(logits, rows)
    pinned_lp, plain = out.logprobs
    assert out.token_ids[0] == 3 and pinned_lp.token_id == 3
    assert [t for t, _ in pinned_lp.top] == pinned
    for (t, value), rank in zip(pinned_lp.top, pinned_lp.top_ranks):
        assert math.isclose(value, expected[0, t].item(), abs_tol=1e-5)
        assert rank == int((expected[0] > expected[0, t]).sum()) + 1
    assert pinned_lp.top_ranks[0] == 50 and pinned_lp.top_ranks[2] == 1
    assert [t for t, _ in plain.top] == expected[1].topk(2).indices.tolist() and plain.top_ranks is None


def test_logprob_token_ids_need_logprobs():
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingParams(logprob_token_ids=[1])
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingParams(logprobs=1, logprob_token_ids=list(range(21)))


def test_no_logprobs_unless_asked():
    out = Sampler()(torch.randn(1, 10), [row(SamplingParams(temperature=0))])
    assert out.logprobs == [None]


def test_logit_bias_moves_the_choice_row_by_row():
    torch.manual_seed(2)
    logits = torch.randn(3, 40)
    best = logits.argmax(-1).tolist()
    rows = [row(SamplingParams(temperature=0, logit_bias={7: 100.0})),
            row(SamplingParams(temperature=0)),
            row(SamplingParams(temperature=0, logit_bias={best[2]: -100.0, 9: 0.5}))]
    raw = logits.clone()
    out = Sampler()(logits, rows)
    assert torch.equal(logits, raw)  # the caller's logits are left alone
    second = logits[2].clone()
    second[best[2]] -= 100
    second[9] += 0.5
    assert out.token_ids == [7, best[1], int(second.argmax())]
    # Log-probabilities stay the model's own (vLLM's raw logprobs).
    biased = Sampler()(logits, [row(SamplingParams(temperature=0, logprobs=0, logit_bias={7: 100.0}))])
    assert math.isclose(biased.logprobs[0].logprob, torch.log_softmax(logits[0], -1)[7].item(), abs_tol=1e-5)


def test_allowed_token_ids_limit_greedy_and_random_choices():
    torch.manual_seed(3)
    logits = torch.randn(2, 50)
    allowed = [3, 11, 29]
    greedy = Sampler()(logits, [row(SamplingParams(temperature=0, allowed_token_ids=allowed)),
                                row(SamplingParams(temperature=0))])
    assert greedy.token_ids == [max(allowed, key=lambda t: logits[0, t]), int(logits[1].argmax())]
    sampler = Sampler(seed=4)
    hot = row(SamplingParams(temperature=2.0, allowed_token_ids=allowed))
    seen = {sampler(logits[:1], [hot]).token_ids[0] for _ in range(200)}
    assert seen == set(allowed)


def test_bad_words_ban_one_token_always_and_a_longer_word_after_its_start():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    params = SamplingParams(temperature=0, bad_words=["x"])  # the ids below stand for its tokens
    assert Sampler()(logits, [row(params, bad_words=[[0]])]).token_ids == [1]
    word = [[3, 1]]  # token 1 is banned only right after a generated 3
    assert Sampler()(logits, [row(params, bad_words=word)]).token_ids == [0]
    assert Sampler()(logits, [row(params, output=[3], bad_words=word, prompt=[0])]).token_ids == [0]
    logits = torch.tensor([[1.0, 5.0, 4.0]])
    assert Sampler()(logits, [row(params, output=[3], bad_words=word)]).token_ids == [2]
    assert Sampler()(logits, [row(params, output=[3, 0], bad_words=word)]).token_ids == [1]
    # Only generated tokens count: a 3 at the end of the prompt does not start the word.
    assert Sampler()(logits, [row(params, prompt=[3], bad_words=word)]).token_ids == [1]


@pytest.mark.parametrize("field,value,words", [
    ("logit_bias", {"5": 1.0}, "non-negative integers"), ("logit_bias", {5: 101}, "[-100, 100]"),
    ("logit_bias", {-1: 1.0}, "non-negative"), ("logit_bias", {5: float("nan")}, "[-100, 100]"),
    ("allowed_token_ids", [], "non-empty"), ("allowed_token_ids", [1, -2], "non-empty list"),
    ("bad_words", ["  "], "not only spaces"), ("bad_words", ["a"] * 129, "at most 128"),
    # -1 is the whole vocabulary; counts above the engine's --max-logprobs are its input
    # processor's and core's to refuse (tests/server/test_max_logprobs.py)
    ("prompt_logprobs", -2, "[-1, "),
])
def test_bad_token_rules_name_the_field(field, value, words):
    with pytest.raises(ValueError, match=field) as caught:
        SamplingParams(**{field: value})
    assert words in str(caught.value)


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -3), ("min_p", 1.5),
    ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0),
    ("max_tokens", 0), ("min_tokens", -1), ("logprobs", -2), ("n", 0), ("stop", [""]),
    ("stop_token_ids", [-1]), ("seed", 1.5),
])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)


# -- the sampling method: candidates and an inverse CDF, against a full sort ------------------------

def reference_probs(logits: torch.Tensor, params: SamplingParams, top_p_margin: float = 0.0) -> torch.Tensor:
    """What a row samples from, by the definition: temperature, top-k and top-p over the whole
    vocabulary sorted, softmax over what is kept, then min_p. top_p_margin moves the nucleus's
    edge: a token whose mass before it is within float32 rounding of top_p is in or out of the
    nucleus depending on the order the sums ran in."""
    scaled = logits / params.temperature
    vocab = scaled.shape[0]
    sorted_logits, order = scaled.sort(descending=True)
    k = vocab if params.top_k == -1 else min(params.top_k, vocab)
    drop = torch.arange(vocab) >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    drop |= probs.cumsum(-1) - probs >= params.top_p + top_p_margin
    kept = torch.empty_like(scaled).scatter_(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(kept, dim=-1)
    probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


params_strategy = st.builds(
    SamplingParams, temperature=st.floats(0.3, 3.0), top_k=st.sampled_from([-1, 1, 5, 40, 300, 5000]),
    top_p=st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.1]), min_p=st.sampled_from([0.0, 0.0, 0.05, 0.3]))


@settings(max_examples=60, deadline=None)
@given(params=st.lists(params_strategy, min_size=1, max_size=6), vocab=st.sampled_from([7, 300, 5000]),
       spread=st.sampled_from([0.01, 1.0, 8.0]), seed=st.integers(0, 2**16))
# Found by a clean-clone run: row 5's edge token has 0.9000003 of the mass before it in a float32
# sort, so the definition drops it, and the sampler, summing in another order, keeps it.
@example(params=[SamplingParams(temperature=1.0)] * 5 + [
    SamplingParams(temperature=1.908728431494526, top_p=0.9, top_k=5000)], vocab=5000, spread=1.0, seed=2043)
def test_candidates_keep_what_a_full_sort_keeps(params, vocab, spread, seed):
    """Whatever the batch, each row's tokens and probabilities (sampling_probs: the sampler's
    candidates and weights over the vocabulary) are those of the definition, including flat rows
    whose nucleus is larger than the first candidate sets (spread 0.01)."""
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(seed)) * spread
    for j, (got, p) in enumerate(zip(sampling_probs(logits, params), params)):
        # The nucleus's edge token (mass before it within 1e-5 of top_p) may go either way.
        candidates = [reference_probs(logits[j], p, margin) for margin in (0.0, -1e-5, 1e-5)]
        errors = [(got - expected).abs().max() for expected in candidates]
        assert any(torch.allclose(got, expected, atol=1e-5) for expected in candidates), (p, errors)



def test_inverse_cdf_picks_each_bin_at_its_edges_and_never_a_zero_weight():
    from pagedllm.worker.sampler import _inverse_cdf

    weights = torch.zeros(3, 700)
    weights[0, [0, 255, 256, 699]] = torch.tensor([1.0, 2.0, 3.0, 4.0])  # bins across blocks
    weights[1, 300] = 5.0  # one token: always it
    weights[2] = torch.rand(700) * (torch.rand(700) < 0.3)
    edges = weights.double().cumsum(-1) / weights.double().sum(-1, keepdim=True)
    for u in [0.0, 0.1, 0.3, 0.5, 0.6, 0.9, 1 - 2**-52]:
        picks = _inverse_cdf(weights.clone(), torch.full((3,), u, dtype=torch.float64))
        assert (weights[torch.arange(3), picks] > 0).all()
        targets = torch.full((3, 1), u, dtype=torch.float64)
        expected = torch.searchsorted(edges, targets, right=True).squeeze(1)
        assert picks.tolist() == expected.tolist(), u
    assert _inverse_cdf(weights[:1].clone(), torch.tensor([0.1 - 1e-9], dtype=torch.float64)).item() == 0
    assert _inverse_cdf(weights[:1].clone(), torch.tensor([0.1 + 1e-9], dtype=torch.float64)).item() == 255


def test_samples_across_blocks_follow_the_distribution():
    probs = torch.full((1, 1000), 0.2 / 997)
    probs[0, [3, 400, 999]] = torch.tensor([0.5, 0.2, 0.1])
    sampler = Sampler(seed=5)
    logits = torch.log(probs).repeat(500, 1)
    counts = torch.bincount(torch.tensor(
        [t for _ in range(8) for t in sampler(logits, [row(SamplingParams())] * 500).token_ids]),
        minlength=1000)
    for token, p in [(3, 0.5), (400, 0.2), (999, 0.1)]:
        assert abs(counts[token].item() / 4000 - p) < 0.03, token
    assert abs(counts.sum().item() - counts[[3, 400, 999]].sum().item() - 0.2 * 4000) < 120


@pytest.mark.parametrize("fields", [{}, {"top_p": 0.9}, {"top_k": 20},
                                    {"top_k": 50, "top_p": 0.8, "min_p": 0.05}])
def test_seeded_rows_repeat_over_steps_whatever_the_batch(fields):
    """A seeded row takes one number per step from its own generator, whatever the other rows
    ask for (their top-k decides how many candidates the batch looks at)."""
    logits = torch.randn(4, 6000, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(seed=11, **fields)

    def walk(batch_rows):
        seeded = row(params, seed=11)
        sampler = Sampler(seed=len(batch_rows))
        tokens = []
        for step in range(5):
            rows = [seeded, *batch_rows]
            tokens.append(sampler(logits[:len(rows)] + step, rows).token_ids[0])
        return tokens

    alone = walk([])
    assert walk([row(SamplingParams(top_k=5000)), row(SamplingParams(temperature=0))]) == alone
    others = [row(SamplingParams(top_p=0.5)), row(SamplingParams(), seed=3), row(SamplingParams())]
    assert walk(others) == alone


@pytest.mark.skipif(not tiers.available(), reason="the compiled CPU kernels did not build here")
def test_the_compiled_kernel_picks_what_the_torch_inverse_cdf_picks():
    """Rows with a temperature alone go through csrc/sample.cpp: the same bins at their edges as
    _inverse_cdf (weights with exact edges: logits 0 or -inf, so every weight is 1 or 0), and on
    random logits the same token for all but a vanishing share of uniforms (its exp rounds apart
    from torch's by an ulp: a pick can differ only when a uniform falls within that of an edge)."""
    from pagedllm.worker.sampler import _inverse_cdf, _weights

    logits = torch.full((2, 700), float("-inf"))
    logits[0, [0, 255, 256, 699]] = 0.0  # four equal bins across blocks
    logits[1, 300] = 0.0  # one token: always it
    rows = torch.tensor([0, 1])
    for u, first in [(0.0, 0), (0.25 - 1e-9, 0), (0.25 + 1e-9, 255), (0.6, 256), (1 - 2**-52, 699)]:
        uniforms = torch.full((2,), u, dtype=torch.float64)
        picks = sampling.sample_plain(logits, rows, torch.tensor([1.0, 0.7]), uniforms)
        assert picks.tolist() == [first, 300], u

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 5000, generator=gen) * 4
    temps = torch.rand(64, generator=gen) * 1.5 + 0.1
    uniforms = torch.rand(64, generator=gen, dtype=torch.float64)
    picks = sampling.sample_plain(logits, torch.arange(64), temps, uniforms)
    scaled = logits / temps.unsqueeze(1)
    expected = _inverse_cdf(_weights(scaled, [SamplingParams()] * 64), uniforms)
    assert (picks == expected).sum().item() >= 63
