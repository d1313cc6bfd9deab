"""Verification: which proposed tokens a speculating sequence keeps, and the one token after them.

A sequence that proposed x_1..x_k runs k + 1 positions in the step; the logits of position j
(0-based) give the target's distribution p_j of the token after x_1..x_j (x_0 being the last
accepted token). Each p_j is the sampler's own: the logits go through the sampler's processing
(pagedllm.worker.sampler.process_logits: token rules, penalties, the min_tokens stop ban) with
the sequence's history extended by x_1..x_j, then its temperature, top-k, top-p and min-p
(sampling_probs). A grammar's mask is the caller's, applied to each position's row before this.

- Greedy requests keep x_{j+1} while it equals the argmax of p_j, then take that argmax: exactly
  the tokens decoding one at a time would give (accept_greedy; from argmax ids alone too).
- Sampled requests use the standard rejection sampler: x_{j+1} is kept with probability
  min(1, p_j(x) / q_j(x)), q_j being the proposer's distribution (a draft model's; n-gram and
  suffix proposals are a point mass, q = 1 on x); at the first rejection the token is drawn from
  the residual max(0, p_j - q_j), normalised (for a point mass: p_j without x); with all k kept,
  a bonus token is drawn from p_k. Each token emitted then follows the target's distribution
  exactly, whatever the proposals were (tests/spec_decode/test_rejection.py: a chi-square test).

Randomness: a sequence takes k + 1 uniform numbers per step (k acceptance tests, one draw), from
its own generator when seeded (SamplingRow.generator), else from one draw of the shared one. A
seeded request thus gives the same output on every run with the same k at each step; the tokens
differ from a run without speculation (which takes one number per token), as vLLM's do. Greedy
requests take none and give the plain run's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pagedllm.outputs import TokenLogprobs
from pagedllm.worker.sampler import (
    Sampler,
    SamplingRow,
    TokenHistory,
    _inverse_cdf,
    process_logits,
    sampling_probs,
)


def accept_greedy(target_ids: list[int], proposal: list[int]) -> list[int]:
    """The tokens a greedy sequence emits: the proposal's prefix that agrees with the target's
    argmax at each position, then the target's token where they part (or after all of them).
    target_ids: the argmax of each of the len(proposal) + 1 positions."""
    if len(target_ids) != len(proposal) + 1:
        raise ValueError(f"{len(target_ids)} target tokens for a proposal of {len(proposal)}: "
                         "need one more than proposed")
    kept = 0
    while kept < len(proposal) and proposal[kept] == target_ids[kept]:
        kept += 1
    return [*proposal[:kept], target_ids[kept]]


@dataclass
class Draft:
    """One speculating sequence in a step: its sampling row, what was proposed, and the
    proposer's distribution at each proposed position ([k, vocab]; None: a point mass)."""

    row: SamplingRow
    proposal: list[int]
    draft_probs: torch.Tensor | None = None

    @property
    def num_positions(self) -> int:
        return len(self.proposal) + 1


@dataclass
class VerifyOutput:
    token_ids: list[list[int]]  # per sequence: its accepted proposal tokens, then one more
    logprobs: list[list[TokenLogprobs] | None]  # per emitted token, for sequences that ask

    def num_accepted(self) -> list[int]:
        return [len(tokens) - 1 for tokens in self.token_ids]


class _Extended:
    """A history as it would read with some proposed tokens appended (penalties, bad words and
    min_tokens at a later position see the tokens before it)."""

    def __init__(self, base: TokenHistory, extra: list[int]) -> None:
        self._base, self._extra = base, extra

    @property
    def token_ids(self) -> list[int]:
        return self._base.token_ids + self._extra

    @property
    def num_output_tokens(self) -> int:
        return self._base.num_output_tokens + len(self._extra)

    @property
    def output_token_ids(self) -> list[int]:
        return self._base.output_token_ids + self._extra


class RejectionSampler:
    """Verifies a step's drafts. Shares the sampler's generator for unseeded requests."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, drafts: list[Draft]) -> VerifyOutput:
        """logits: [sum of num_positions, vocab], each draft's positions in order, drafts in order."""
        starts = [0]
        for draft in drafts:
            starts.append(starts[-1] + draft.num_positions)
        if logits.shape[0] != starts[-1]:
            raise ValueError(f"{logits.shape[0]} logit rows for drafts of {starts[-1]} positions")
        raw = logits.float()
        rows = [replace(d.row, history=_Extended(d.row.history, d.proposal[:j]) if j else d.row.history)
                for d in drafts for j in range(d.num_positions)]
        processed = process_logits(raw, rows)
        tokens: list[list[int]] = [[] for _ in drafts]
        greedy = [i for i, d in enumerate(drafts) if d.row.params.greedy]
        if greedy:
            at = torch.tensor([r for i in greedy for r in range(starts[i], starts[i + 1])],
                              dtype=torch.long, device=logits.device)
            argmax = processed[at].max(dim=-1).indices.tolist()
            offset = 0
            for i in greedy:
                n = drafts[i].num_positions
                tokens[i] = accept_greedy(argmax[offset:offset + n], drafts[i].proposal)
                offset += n
        sampled = [i for i, d in enumerate(drafts) if not d.row.params.greedy]
        if sampled:
            self._verify_sampled(processed, drafts, starts, sampled, tokens)
        return VerifyOutput(tokens, self._logprobs(raw, drafts, starts, tokens))

    def _verify_sampled(self, processed: torch.Tensor, drafts: list[Draft], starts: list[int],
                        sampled: list[int], tokens: list[list[int]]) -> None:
        device = processed.device
        at = torch.tensor([r for i in sampled for r in range(starts[i], starts[i + 1])],
                          dtype=torch.long, device=device)
        params = [drafts[i].row.params for i in sampled for _ in range(drafts[i].num_positions)]
        probs = sampling_probs(processed[at], params)  # [positions of sampled drafts, vocab]
        uniforms = self._uniforms([drafts[i] for i in sampled], device)
        finals, final_uniforms = [], []
        offset = 0
        for i, u in zip(sampled, uniforms):
            draft = drafts[i]
            k = len(draft.proposal)
            p = probs[offset:offset + k + 1]
            offset += k + 1
            kept = _num_accepted(p, draft, u[:k])
            tokens[i] = draft.proposal[:kept]
            finals.append(p[kept] if kept == k else _residual(p[kept], draft, kept))
            final_uniforms.append(u[k])
        drawn = _inverse_cdf(torch.stack(finals), torch.stack(final_uniforms)).tolist()
        for i, token in zip(sampled, drawn):
            tokens[i].append(token)

    def _uniforms(self, drafts: list[Draft], device: torch.device) -> list[torch.Tensor]:
        """k + 1 uniform numbers (float64) per draft: a seeded draft's from its own generator,
        the others' from one draw of the shared generator."""
        sizes = [d.num_positions for d in drafts]
        shared = torch.rand(sum(sizes), dtype=torch.float64, generator=self.sampler.generator,
                            device=device).split(sizes)
        return [torch.rand(n, dtype=torch.float64, generator=d.row.generator, device=device)
                if d.row.generator is not None else u for d, n, u in zip(drafts, sizes, shared)]

    @staticmethod
    def _logprobs(raw: torch.Tensor, drafts: list[Draft], starts: list[int],
                  tokens: list[list[int]]) -> list[list[TokenLogprobs] | None]:
        """Each emitted token's logprob from its position's raw logits, as the sampler reports."""
        result: list[list[TokenLogprobs] | None] = []
        for i, draft in enumerate(drafts):
            num_top = draft.row.params.logprobs
            if num_top is None:
                result.append(None)
                continue
            rows = raw[starts[i]:starts[i] + len(tokens[i])]
            result.append(Sampler.logprobs_of(rows, tokens[i], num_top, draft.row.params.logprob_token_ids))
        return result


def _num_accepted(p: torch.Tensor, draft: Draft, uniforms: torch.Tensor) -> int:
    """How many proposed tokens pass their test u < p(x) / q(x), in order, up to the first
    that fails (compared as u * q(x) < p(x): no division by a zero q)."""
    k = len(draft.proposal)
    if not k:
        return 0
    index = torch.tensor(draft.proposal, dtype=torch.long, device=p.device)
    p_x = p[:k].gather(1, index.unsqueeze(1)).squeeze(1).double()
    q_x = (torch.ones_like(p_x) if draft.draft_probs is None
           else draft.draft_probs.gather(1, index.unsqueeze(1)).squeeze(1).double())
    passed = (uniforms.to(p.device) * q_x < p_x).tolist()
    return next((j for j, ok in enumerate(passed) if not ok), k)


def _residual(p: torch.Tensor, draft: Draft, position: int) -> torch.Tensor:
    """max(0, p - q) at a rejected position (its scale does not matter to the draw); p itself
    where that leaves nothing (p equal to q up to rounding: a rejection there is rounding too)."""
    if draft.draft_probs is None:
        residual = p.clone()
        residual[draft.proposal[position]] = 0.0
    else:
        residual = (p - draft.draft_probs[position].to(p)).clamp_(min=0.0)
    return residual if residual.sum() > 0 else p
