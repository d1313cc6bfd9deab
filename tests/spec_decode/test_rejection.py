"""Verification: greedy gives the one-token-at-a-time tokens; the rejection sampler's tokens follow
the target's distribution whatever the proposer (chi-square), and a wrong rule is caught."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode import rejection
from pagedllm.spec_decode.rejection import Draft, RejectionSampler, accept_greedy
from pagedllm.worker.sampler import Sampler, SamplingRow, TokenRules, process_logits, sampling_probs


def make_row(params: SamplingParams, prompt=(1, 2), seed=None, stops=(), bad_words=()) -> SamplingRow:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    rules = TokenRules.build(params, tuple(map(tuple, bad_words)), torch.device("cpu"))
    return SamplingRow(params, Request("r", list(prompt), params), tuple(stops), generator, rules)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The chance of a chi-square statistic at least this large if counts were drawn from probs
    (cells of zero probability must be empty: a count there is impossible)."""
    total = counts.sum()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = probs[support].double() * total
    statistic = ((counts[support].double() - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2).item()


def test_accept_greedy():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all kept, then a bonus
    assert accept_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # parts at the second
    assert accept_greedy([4], []) == [4]
    with pytest.raises(ValueError, match="one more than proposed"):
        accept_greedy([1, 2], [1, 2])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), k=st.integers(0, 5), agree=st.integers(0, 5),
       penalty=st.sampled_from([1.0, 1.3]), min_tokens=st.integers(0, 3))
def test_greedy_equals_decoding_one_token_at_a_time(seed, k, agree, penalty, min_tokens):
    """The tokens kept and the one after are what the sampler gives position by position with the
    history grown by each token: penalties, min_tokens and bad words read the proposed tokens."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 12
    logits = torch.randn(k + 1, vocab, generator=gen) * 3
    params = SamplingParams(temperature=0, repetition_penalty=penalty, min_tokens=min_tokens)
    row = make_row(params, prompt=(1, 2, 3), stops=(0,), bad_words=[[4, 5]])
    # A proposal agreeing with the step-by-step tokens for `agree` positions, then arbitrary.
    plain = Request("r", [1, 2, 3], params)
    expected = []
    for j in range(k + 1):
        step_row = SamplingRow(params, plain, (0,), None, row.rules)
        token = Sampler()(logits[j:j + 1], [step_row]).token_ids[0]
        expected.append(token)
        plain.append_token(token)
    proposal = [t if j < agree else int(torch.randint(vocab, (), generator=gen)) for j, t in
                enumerate(expected[:k])]
    out = RejectionSampler(Sampler())(logits, [Draft(row, proposal)])
    kept = next((j for j in range(k) if proposal[j] != expected[j]), k)
    assert out.token_ids == [expected[:kept + 1]]
    assert out.num_accepted() == [kept]


def _verify_many(logits_per_position: torch.Tensor, params: SamplingParams, proposals: list[list[int]],
                 draft_probs: torch.Tensor | None, seed: int = 0) -> list[list[int]]:
    """Every proposal verified against the same target logits (one row per position)."""
    k = logits_per_position.shape[0] - 1
    drafts = [Draft(make_row(params), p, draft_probs) for p in proposals]
    logits = logits_per_position.repeat(len(proposals), 1)
    assert all(len(p) == k for p in proposals)
    return RejectionSampler(Sampler(seed=seed))(logits, drafts).token_ids


TARGET = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03],
                                 [0.05, 0.1, 0.6, 0.2, 0.05],
                                 [0.3, 0.3, 0.2, 0.1, 0.1],
                                 [0.02, 0.08, 0.1, 0.2, 0.6]]))
PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
          SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=1.0, min_p=0.1)]


def _proposals(kind: str, num: int, gen: torch.Generator) -> tuple[list[list[int]], torch.Tensor | None]:
    k = TARGET.shape[0] - 1
    if kind == "wrong point mass":  # always the target's least likely tokens
        return [[4, 0, 4][:k]] * num, None
    if kind == "random point mass":
        return torch.randint(5, (num, k), generator=gen).tolist(), None
    # A draft model whose q is far from p: the proposals drawn from q, q handed over.
    q = torch.tensor([[0.05, 0.05, 0.1, 0.2, 0.6], [0.6, 0.2, 0.1, 0.05, 0.05], [0.1, 0.1, 0.1, 0.1, 0.6]])
    draws = torch.stack([torch.multinomial(q[j], num, replacement=True, generator=gen) for j in range(k)], 1)
    return draws.tolist(), q


def _position_counts(outputs: list[list[int]], position: int) -> torch.Tensor:
    """Counts of the token at `position` among outputs that reach it."""
    tokens = [out[position] for out in outputs if len(out) > position]
    return torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=5)


@pytest.mark.parametrize("kind", ["wrong point mass", "random point mass", "skewed draft model"])
@pytest.mark.parametrize("params", PARAMS, ids=["t1", "topk", "topp", "minp"])
def test_emitted_tokens_follow_the_target(kind, params):
    """Position by position (each reached only when the ones before were kept), the tokens are
    distributed as the target's p there: chi-square, 20,000 drafts."""
    gen = torch.Generator().manual_seed(11)
    proposals, q = _proposals(kind, 20000, gen)
    outputs = _verify_many(TARGET, params, proposals, q)
    target = sampling_probs(process_logits(TARGET.clone(), [make_row(params)] * 4), [params] * 4)
    for position in range(3):
        counts = _position_counts(outputs, position)
        if counts.sum() < 500:  # rarely reached (a point mass the target seldom draws)
            continue
        assert chi_square_p_value(counts, target[position]) > 1e-4, (position, counts, target[position])


@pytest.mark.parametrize("wrong_rule", ["resample from p", "accept every proposal"])
def test_a_wrong_rule_fails_the_same_test(monkeypatch, wrong_rule):
    """The test above has teeth: drawing the replacement from p instead of the residual, or
    keeping proposals untested, skews the first token far past any chance."""
    if wrong_rule == "resample from p":
        monkeypatch.setattr(rejection, "_residual", lambda p, draft, position: p)
    else:
        monkeypatch.setattr(rejection, "_num_accepted", lambda p, draft, u: len(draft.proposal))
    gen = torch.Generator().manual_seed(11)
    # (Not a uniformly random proposer: against it, drawing from p after a rejection happens to
    # give p again.)
    proposals, q = _proposals("wrong point mass", 20000, gen)
    outputs = _verify_many(TARGET, PARAMS[0], proposals, q)
    target = sampling_probs(TARGET.clone(), [PARAMS[0]] * 4)
    assert chi_square_p_value(_position_counts(outputs, 0), target[0]) < 1e-6


def test_seeded_drafts_repeat_whatever_the_batch():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=5)

    def run(extra: int, sampler_seed: int) -> list[int]:
        others = [Draft(make_row(SamplingParams(temperature=1.0)), [1, 2, 3]) for _ in range(extra)]
        mine = Draft(make_row(params, seed=5), [7, 8, 9])
        drafts = others[:1] + [mine] + others[1:]
        out = RejectionSampler(Sampler(seed=sampler_seed))(logits.repeat(len(drafts), 1), drafts)
        return out.token_ids[min(1, extra)]

    first = run(0, 0)
    assert all(run(extra, seed) == first for extra, seed in [(1, 1), (3, 2), (5, 9)])


def test_logprobs_of_emitted_tokens():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(4))
    target = logits.argmax(-1).tolist()
    row = make_row(SamplingParams(temperature=0, logprobs=2))
    out = RejectionSampler(Sampler())(logits, [Draft(row, [target[0], (target[1] + 1) % 20])])
    assert out.token_ids == [target[:2]]
    (lps,) = out.logprobs
    expected = torch.log_softmax(logits, -1)
    assert [lp.token_id for lp in lps] == target[:2]
    for j, lp in enumerate(lps):
        assert lp.logprob == pytest.approx(expected[j, target[j]].item(), abs=1e-5)
        assert len(lp.top) == 2


def test_rows_must_match_the_drafts():
    with pytest.raises(ValueError, match="4 logit rows for drafts of 3 positions"):
        RejectionSampler(Sampler())(torch.zeros(4, 5), [Draft(make_row(SamplingParams()), [1, 2])])
