"""Batched sampling: one call per step over every sequence that needs a token.

Rows are independent: a row's sample depends only on its own logits, parameters and (when
seeded) its own generator, so the result never changes with what else is in the batch.

Everything runs on the logits' device (generators included: a seeded request's draws come from a
generator on that device, so the same seed gives other tokens on a GPU than on the CPU); the chosen
ids and logprobs come back to the host once, at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pagedllm.core_messages import TokenLogprobs
from pagedllm.sampling_params import SamplingParams


class TokenHistory(Protocol):
    """A sequence's tokens as penalties and min_tokens read them (a Request is one)."""

    token_ids: list[int]  # prompt, then output

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def output_token_ids(self) -> list[int]: ...


@dataclass(frozen=True, eq=False)
class TokenRules:
    """A request's fixed rules on which tokens may come: allowed_token_ids, bad_words and
    logit_bias, as tensors made once (per request, shared by its sequences) on the logits' device."""

    allowed_ids: torch.Tensor | None  # [k] long: sample only among these
    bias_ids: torch.Tensor | None  # [b] long, with bias_values [b] float32 added to their logits
    bias_values: torch.Tensor | None
    banned_ids: torch.Tensor | None  # one-token bad words: never
    # Longer bad words: (the tokens before the last, the last), banned right after the others.
    bad_word_ends: tuple[tuple[tuple[int, ...], int], ...]

    @classmethod
    def build(cls, params: SamplingParams, bad_words_token_ids: tuple[tuple[int, ...], ...],
              device: torch.device) -> TokenRules | None:
        """The rules of a request; None when it has none (the sampler then does no work for it)."""
        if params.allowed_token_ids is None and not params.logit_bias and not bad_words_token_ids:
            return None

        def ids(values) -> torch.Tensor | None:
            return torch.tensor(list(values), dtype=torch.long, device=device) if values else None

        bias = params.logit_bias or {}
        singles = sorted({w[0] for w in bad_words_token_ids if len(w) == 1})
        return cls(
            allowed_ids=ids(sorted(set(params.allowed_token_ids or ()))),
            bias_ids=ids(bias), bias_values=torch.tensor(list(bias.values()), dtype=torch.float32,
                                                          device=device) if bias else None,
            banned_ids=ids(singles),
            bad_word_ends=tuple((tuple(w[:-1]), w[-1]) for w in bad_words_token_ids if len(w) > 1))

    def bad_word_bans(self, history: TokenHistory) -> list[int]:
        """The last tokens of the longer bad words whose other tokens the output ends with now
        (vLLM's rule: only generated tokens count)."""
        num_output = history.num_output_tokens
        tokens = history.token_ids
        return [last for before, last in self.bad_word_ends
                if len(before) <= num_output and tuple(tokens[len(tokens) - len(before):]) == before]


@dataclass
class SamplingRow:
    """What the sampler needs for one row of logits. Made once per sequence and kept: history is
    the sequence itself, read when sampling, its tokens never copied unless a penalty needs them."""

    params: SamplingParams
    history: TokenHistory
    stop_ids_before_min_tokens: tuple[int, ...]  # ids banned while fewer than min_tokens are out
    generator: torch.Generator | None  # a seeded request's own, on the logits' device; None: the shared one
    rules: TokenRules | None = None  # allowed_token_ids, bad_words, logit_bias


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, seed: int = 0, device: str | torch.device = "cpu") -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        raw = logits.float()
        logits = self._apply_token_rules(raw, rows)
        logits = self._apply_penalties(logits, rows)
        logits = self._ban_early_stops(logits, rows)
        token_ids = self._choose(logits, rows)
        logprobs = self._logprobs(raw, token_ids, rows)
        return SamplerOutput(token_ids.tolist(), logprobs)

    # -- logit processing -----------------------------------------------------------------
    def _apply_token_rules(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """allowed_token_ids, bad_words and logit_bias: one masked fill and one indexed add over
        the rows that have any (a step without them costs one pass over the rows)."""
        ruled = [(i, r.rules) for i, r in enumerate(rows) if r.rules is not None]
        if not ruled:
            return logits
        logits = logits.clone()
        device = logits.device
        restricted = [(i, rules.allowed_ids) for i, rules in ruled if rules.allowed_ids is not None]
        if restricted:
            index = torch.tensor([i for i, _ in restricted], dtype=torch.long, device=device)
            outside = torch.ones(len(restricted), logits.shape[1], dtype=torch.bool, device=device)
            for j, (_, allowed) in enumerate(restricted):
                outside[j].index_fill_(0, allowed, False)
            logits[index] = logits[index].masked_fill(outside, float("-inf"))
        ban_rows, ban_ids = [], []
        for i, rules in ruled:
            if rules.banned_ids is not None:
                ban_ids.append(rules.banned_ids)
                ban_rows.append(torch.full_like(rules.banned_ids, i))
            if rules.bad_word_ends:
                ends = rules.bad_word_bans(rows[i].history)
                ban_ids.append(torch.tensor(ends, dtype=torch.long, device=device))
                ban_rows.append(torch.full_like(ban_ids[-1], i))
        if ban_ids:
            logits.index_put_((torch.cat(ban_rows), torch.cat(ban_ids)),
                              torch.tensor(float("-inf"), device=device))
        biased = [(i, rules) for i, rules in ruled if rules.bias_ids is not None]
        if biased:
            row_index = torch.cat([torch.full_like(rules.bias_ids, i) for i, rules in biased])
            logits.index_put_((row_index, torch.cat([rules.bias_ids for _, rules in biased])),
                              torch.cat([rules.bias_values for _, rules in biased]), accumulate=True)
        return logits

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        needs = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
        if not needs:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in needs:
            p = rows[i].params
            row = logits[i]
            if p.repetition_penalty != 1.0:
                # HF/vLLM convention: every token seen in prompt or output is pushed away.
                # (Filtered here, not with a mask on the device: no shape that needs a sync.)
                seen = torch.tensor(sorted(t for t in set(rows[i].history.token_ids) if t < vocab),
                                    dtype=torch.long, device=logits.device)
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and rows[i].history.num_output_tokens:
                # OpenAI convention: only generated tokens count.
                out = torch.tensor([t for t in rows[i].history.output_token_ids if t < vocab],
                                   dtype=torch.long, device=logits.device)
                counts = torch.zeros_like(row).index_add_(0, out, torch.ones_like(out, dtype=row.dtype))
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        return logits

    def _ban_early_stops(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        banned = [(i, r.stop_ids_before_min_tokens) for i, r in enumerate(rows)
                  if r.stop_ids_before_min_tokens and r.history.num_output_tokens < r.params.min_tokens]
        if not banned:
            return logits
        logits = logits.clone()
        for i, ids in banned:
            banned_ids = torch.tensor([t for t in ids if t < logits.shape[1]], dtype=torch.long,
                                      device=logits.device)
            row = logits[i]
            # Where a grammar allows only a stop token (its output is complete), the grammar
            # wins: a row is never left with nothing to draw. No host sync: a where on device.
            others_allowed = row.index_fill(0, banned_ids, float("-inf")).isfinite().any()
            row[banned_ids] = torch.where(others_allowed, float("-inf"), row[banned_ids])
        return logits

    # -- choosing --------------------------------------------------------------------------
    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        # max(dim).indices is argmax (the first maximal index too), three times faster on CPU.
        chosen = logits.max(dim=-1).indices
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not random_rows:
            return chosen
        index = torch.tensor(random_rows, dtype=torch.long, device=logits.device)
        params = [rows[i].params for i in random_rows]
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype,
                             device=logits.device).unsqueeze(1)
        scaled = logits[index] / temps
        scaled = _top_k_top_p(scaled, params)
        probs = torch.softmax(scaled, dim=-1)
        probs = _min_p(probs, params)
        # Exponential race (argmax p/q with q ~ Exp(1)) is an exact categorical sample and lets
        # each seeded row draw its noise from its own generator.
        noise = torch.empty_like(probs)
        for j, i in enumerate(random_rows):
            noise[j].exponential_(generator=rows[i].generator or self.generator)
        chosen[index] = (probs / noise).max(dim=-1).indices
        return chosen

    # -- logprobs --------------------------------------------------------------------------
    def _logprobs(self, raw: torch.Tensor, token_ids: torch.Tensor,
                  rows: list[SamplingRow]) -> list[TokenLogprobs | None]:
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        result: list[TokenLogprobs | None] = [None] * len(rows)
        if not wanted:
            return result
        index = torch.tensor(wanted, dtype=torch.long, device=raw.device)
        found = _token_logprobs(raw[index], token_ids[index], [rows[i].params.logprobs for i in wanted])
        for i, entry in zip(wanted, found):
            result[i] = entry
        return result

    @staticmethod
    def logprobs_of(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
        """Each row's log-probability of a given token (a prompt's next token), its rank and the
        num_top best, from the raw logits [len(token_ids), vocab]."""
        chosen = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
        return _token_logprobs(logits.float(), chosen, [num_top] * len(token_ids))


def _token_logprobs(raw: torch.Tensor, chosen: torch.Tensor, nums_top: list[int]) -> list[TokenLogprobs]:
    """Log-softmax of each row of raw: the chosen token's value and rank, and the row's top-n."""
    logp = torch.log_softmax(raw, dim=-1)
    chosen_logp = logp.gather(1, chosen.unsqueeze(1)).squeeze(1)
    ranks = (logp > chosen_logp.unsqueeze(1)).sum(dim=1) + 1
    top_vals, top_ids = logp.topk(max(max(nums_top), 1), dim=-1)
    # To the host once, not per row.
    chosen, chosen_logp, ranks = chosen.tolist(), chosen_logp.tolist(), ranks.tolist()
    top_ids, top_vals = top_ids.tolist(), top_vals.tolist()
    # A token a grammar forbids (-inf) is no alternative: fewer than n may be left.
    return [TokenLogprobs(chosen[j], chosen_logp[j], ranks[j],
                          [(t, v) for t, v in zip(top_ids[j][:n], top_vals[j][:n]) if v != float("-inf")])
            for j, n in enumerate(nums_top)]


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    top_ks = [p.top_k for p in params]
    top_ps = [p.top_p for p in params]
    if all(k == -1 for k in top_ks) and all(p >= 1.0 for p in top_ps):
        return logits
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.tensor([vocab if k == -1 else min(k, vocab) for k in top_ks], device=logits.device).unsqueeze(1)
    drop = ranks >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it
    # already reaches p (the first token is always kept).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= torch.tensor(top_ps, dtype=probs.dtype, device=probs.device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _min_p(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    min_ps = [p.min_p for p in params]
    if not any(min_ps):
        return probs
    threshold = (torch.tensor(min_ps, dtype=probs.dtype, device=probs.device).unsqueeze(1)
                 * probs.max(dim=-1, keepdim=True).values)
    return probs.masked_fill(probs < threshold, 0.0)
