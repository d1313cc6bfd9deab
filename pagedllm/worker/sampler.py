"""Batched sampling: one call per step over every sequence that needs a token.

Rows are independent: a row's sample depends only on its own logits, parameters and (when
seeded) its own generator, so the result never changes with what else is in the batch.

Random rows are sampled by inverse CDF: one uniform number per row (one draw for every unseeded
row; a seeded row's own from its own generator), then the first token whose cumulative
probability passes it. Drawing noise for every token of a 49k vocabulary (an exponential race)
cost ~200 ms a step at 64 rows on one core; this costs ~20. Top-k and top-p look only at the
likeliest tokens (a partial sort, torch.topk) and fall back to more only when the nucleus is
larger: what they keep is what a sort of the whole vocabulary keeps (tests/worker/test_sampler.py
checks it against that definition).

Everything runs on the logits' device (generators included: a seeded request's draws come from a
generator on that device, so the same seed gives other tokens on a GPU than on the CPU); the chosen
ids and logprobs come back to the host once, at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pagedllm.kernels import sampling, tiers
from pagedllm.outputs import TokenLogprobs
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


def takes_argmax(row: SamplingRow) -> bool:
    """Whether the row's token is its logits' argmax with nothing else read from them: greedy, no
    token rules, penalties, early-stop ban or logprobs (the engine may ask the model for the argmax
    alone). Sampler.__call__ gives the same token for it."""
    p = row.params
    return (p.greedy and row.rules is None and not _has_penalty(p) and p.logprobs is None
            and not (row.stop_ids_before_min_tokens and row.history.num_output_tokens < p.min_tokens))


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, seed: int = 0, device: str | torch.device = "cpu") -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        raw = logits.float()
        token_ids = self._choose(process_logits(raw, rows), rows)
        logprobs = self._logprobs(raw, token_ids, rows)
        return SamplerOutput(token_ids.tolist(), logprobs)

    # -- logit processing (process_logits) -------------------------------------------------
    @staticmethod
    def _apply_token_rules(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
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

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
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
                # In float64 (a penalty near 0 is 0 in float32: -inf * 0 is NaN) and held finite:
                # a penalty of 1e-300 sends seen tokens' logits past float32 (inf - inf in the
                # softmax is NaN, and a NaN row drew token ids outside the vocabulary).
                vals = row[seen].double()
                big = torch.finfo(row.dtype).max
                penalized = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
                row[seen] = torch.where(vals.isinf(), vals, penalized.clamp(-big, big)).to(row.dtype)
            if (p.presence_penalty or p.frequency_penalty) and rows[i].history.num_output_tokens:
                # OpenAI convention: only generated tokens count.
                out = torch.tensor([t for t in rows[i].history.output_token_ids if t < vocab],
                                   dtype=torch.long, device=logits.device)
                counts = torch.zeros_like(row).index_add_(0, out, torch.ones_like(out, dtype=row.dtype))
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        return logits

    @staticmethod
    def _ban_early_stops(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
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
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if len(random_rows) == len(rows):
            chosen = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        else:  # max(dim).indices is argmax (the first maximal index too), three times faster on CPU
            chosen = logits.max(dim=-1).indices
        if not random_rows:
            return chosen
        device = logits.device
        index = torch.tensor(random_rows, dtype=torch.long, device=device)
        params = [rows[i].params for i in random_rows]
        uniforms = self.uniforms([rows[i].generator for i in random_rows], device)
        picks = torch.empty(len(random_rows), dtype=torch.long, device=device)
        # Rows with a temperature alone: the compiled kernel's one pass (csrc/sample.cpp) where it
        # runs, the same inverse CDF as _inverse_cdf below; the others, and any row elsewhere:
        # torch ops over their candidates.
        compiled = _compiled_rows(logits, params)
        if compiled:
            at = torch.tensor(compiled, dtype=torch.long, device=device)
            temps = torch.tensor([params[j].temperature for j in compiled], dtype=torch.float32)
            picks[at] = sampling.sample_plain(logits, index[at], temps, uniforms[at].contiguous())
        taken = set(compiled)
        rest = [j for j in range(len(params)) if j not in taken]
        if rest:
            at = torch.tensor(rest, dtype=torch.long, device=device)
            rest_params = [params[j] for j in rest]
            temps = torch.tensor([p.temperature for p in rest_params], dtype=logits.dtype,
                                 device=device).unsqueeze(1)
            scaled = logits[index[at]].div_(temps)  # indexing copied the rows: in place is safe
            for group, values, token_ids in _candidates(scaled, rest_params):
                weights = _weights(values, [rest_params[j] for j in group])
                picked = _inverse_cdf(weights, uniforms[at[group]])
                if token_ids is not None:  # a position among the candidates: its token id
                    picked = token_ids.gather(1, picked.unsqueeze(1)).squeeze(1)
                picks[at[group]] = picked
        chosen[index] = picks
        return chosen

    def uniforms(self, generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
        """One uniform number per row, all of them from one draw of the shared generator, then
        each seeded row's own from its own generator: a seeded row takes exactly one number per
        step from its generator whatever else is in the batch, so its samples are reproducible."""
        uniforms = torch.rand(len(generators), dtype=torch.float64, generator=self.generator, device=device)
        for j, generator in enumerate(generators):
            if generator is not None:
                uniforms[j] = torch.rand((), dtype=torch.float64, generator=generator, device=device)
        return uniforms

    # -- logprobs --------------------------------------------------------------------------
    def _logprobs(self, raw: torch.Tensor, token_ids: torch.Tensor,
                  rows: list[SamplingRow]) -> list[TokenLogprobs | None]:
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        result: list[TokenLogprobs | None] = [None] * len(rows)
        if not wanted:
            return result
        index = torch.tensor(wanted, dtype=torch.long, device=raw.device)
        found = _token_logprobs(raw[index], token_ids[index], [rows[i].params.logprobs for i in wanted],
                                [rows[i].params.logprob_token_ids for i in wanted])
        for i, entry in zip(wanted, found):
            result[i] = entry
        return result

    @staticmethod
    def logprobs_of(logits: torch.Tensor, token_ids: list[int], num_top: int,
                    pinned: list[int] | None = None) -> list[TokenLogprobs]:
        """Each row's log-probability of a given token (a prompt's next token), its rank and the
        num_top best (or the pinned tokens'), from the raw logits [len(token_ids), vocab]."""
        chosen = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
        return _token_logprobs(logits.float(), chosen, [num_top] * len(token_ids), [pinned] * len(token_ids))


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The logits each row samples from (float32 logits in): its token rules, penalties and
    min_tokens' stop ban applied, on a copy where anything changes. The sampler and the rejection
    sampler of speculative decoding (pagedllm.spec_decode.rejection) both start from here."""
    logits = Sampler._apply_token_rules(logits, rows)
    logits = Sampler._apply_penalties(logits, rows)
    return Sampler._ban_early_stops(logits, rows)


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[rows, vocab] float32: the distribution each row's token is drawn from, given its processed
    logits (process_logits): temperature, top-k, top-p and min-p as Sampler._choose applies them
    (the same candidate sets and weights); a greedy row's mass all on its argmax."""
    probs = torch.zeros_like(logits, dtype=torch.float32)
    device = logits.device
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        index = torch.tensor(greedy, dtype=torch.long, device=device)
        probs[index, logits[index].max(dim=-1).indices] = 1.0
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return probs
    index = torch.tensor(random_rows, dtype=torch.long, device=device)
    rest = [params[i] for i in random_rows]
    temps = torch.tensor([p.temperature for p in rest], dtype=logits.dtype, device=device).unsqueeze(1)
    scaled = logits[index].div_(temps)
    for group, values, token_ids in _candidates(scaled, rest):
        weights = _weights(values, [rest[j] for j in group]).float()
        weights /= weights.sum(dim=-1, keepdim=True)
        if token_ids is not None:
            weights = torch.zeros(len(group), logits.shape[1], device=device).scatter_(1, token_ids, weights)
        probs[index[torch.tensor(group, dtype=torch.long, device=device)]] = weights
    return probs


def _token_logprobs(raw: torch.Tensor, chosen: torch.Tensor, nums_top: list[int],
                    pinned: list[list[int] | None] | None = None) -> list[TokenLogprobs]:
    """Log-softmax of each row of raw: the chosen token's value and rank, and the row's top-n, or
    where pinned gives a row token ids (logprob_token_ids), those tokens' values and ranks."""
    logp = torch.log_softmax(raw, dim=-1)
    chosen_logp = logp.gather(1, chosen.unsqueeze(1)).squeeze(1)
    ranks = (logp > chosen_logp.unsqueeze(1)).sum(dim=1) + 1
    top_vals, top_ids = logp.topk(max(max(nums_top), 1), dim=-1)
    # To the host once, not per row.
    chosen, chosen_logp, ranks = chosen.tolist(), chosen_logp.tolist(), ranks.tolist()
    top_ids, top_vals = top_ids.tolist(), top_vals.tolist()
    # A token a grammar forbids (-inf) is no alternative: fewer than n may be left.
    found = [TokenLogprobs(chosen[j], chosen_logp[j], ranks[j],
                           [(t, v) for t, v in zip(top_ids[j][:n], top_vals[j][:n]) if v != float("-inf")])
             for j, n in enumerate(nums_top)]
    for j, ids in enumerate(pinned or ()):
        if ids is not None:
            found[j].top, found[j].top_ranks = _pinned_logprobs(logp[j], ids)
    return found


def _pinned_logprobs(logp: torch.Tensor, token_ids: list[int]) -> tuple[list[tuple[int, float]], list[int]]:
    """Given tokens' log-probabilities in one row of logp, and their ranks (1: the likeliest)."""
    index = torch.tensor(token_ids, dtype=torch.long, device=logp.device)
    values = logp[index]
    ranks = (logp.unsqueeze(0) > values.unsqueeze(1)).sum(dim=1) + 1
    return list(zip(token_ids, values.tolist())), ranks.tolist()


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


# Rows with top-p but no top-k look for their nucleus among this many likeliest tokens first, then
# among more (a partial sort: torch.topk), and sort the whole vocabulary only if the nucleus is
# larger still (a very flat distribution). On a 49k vocabulary, 64 rows: topk(256) takes ~18 ms
# on one core, a full sort ~500 ms.
TOP_P_CANDIDATES = (256, 4096)
# The inverse CDF sums blocks of this many weights first, then one block: two short cumulative
# sums in float64 instead of one over the vocabulary (float32 over 49k tokens would round the
# tail's bins by whole ulps of the running total, float64 over all of them is slow on CPU).
CDF_BLOCK = 256


def _compiled_rows(logits: torch.Tensor, params: list[SamplingParams]) -> list[int]:
    """Positions of the rows the compiled sampling kernel takes: a temperature and nothing else
    (no top-k, top-p or min-p), CPU float32 logits with contiguous rows."""
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.stride(-1) != 1
            or not tiers.available()):
        return []
    return [j for j, p in enumerate(params) if p.top_k == -1 and p.top_p >= 1.0 and not p.min_p]


def _candidates(scaled: torch.Tensor, params: list[SamplingParams]):
    """The tokens each row may sample, in groups of rows: (row positions, logits [rows, C] with
    -inf for the tokens top-k and top-p drop, their token ids [rows, C] or None for the whole
    vocabulary in order).

    Only the likeliest tokens can survive top-k and top-p, so those rows look at a few of them
    (torch.topk, sorted) instead of sorting the vocabulary. The kept set is the one a full sort
    keeps: top-k's k likeliest, then the smallest prefix whose probability (within those k)
    reaches top_p. Rows without either sample from the whole vocabulary."""
    vocab = scaled.shape[1]
    plain = [j for j, p in enumerate(params) if p.top_k == -1 and p.top_p >= 1.0]
    if plain:
        yield plain, _rows(scaled, plain), None
    pending = [j for j, p in enumerate(params) if p.top_k != -1 or p.top_p < 1.0]
    # Where sorting is cheap (a GPU), sort at once: no candidate sets, no check read back.
    counts = (*TOP_P_CANDIDATES, vocab) if scaled.device.type == "cpu" else (vocab,)
    for count in counts:
        if not pending:
            return
        wants = max(min(params[j].top_k, vocab) if params[j].top_k != -1 else count for j in pending)
        rows = _rows(scaled, pending)
        values, token_ids = rows.topk(min(wants, vocab), dim=-1)
        values, fits = _truncate(values, rows, [params[j] for j in pending])
        # Only a top-p row without top-k can miss, and not when every token was a candidate.
        if values.shape[1] == vocab or all(params[j].top_k != -1 for j in pending):
            fits = [True] * len(pending)
        else:
            fits = fits.tolist()
        done = [k for k, ok in enumerate(fits) if ok]
        if done:
            yield [pending[k] for k in done], _rows(values, done), _rows(token_ids, done)
        pending = [j for j, ok in zip(pending, fits) if not ok]


def _rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Those rows of tensor; the tensor itself (no copy) when that is all of them."""
    if len(rows) == tensor.shape[0]:
        return tensor
    return tensor[torch.tensor(rows, dtype=torch.long, device=tensor.device)]


def _truncate(values: torch.Tensor, scaled: torch.Tensor,
              params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k then top-p over candidates sorted by likelihood (values [rows, C] of the rows
    `scaled` [rows, vocab]; -inf = dropped), and for each row (a bool tensor) whether its cut
    surely lies among the C candidates: always with top-k (the k likeliest are all there), with
    top-p alone when the candidates hold at least top_p of the probability (every later token
    has at least that much before it, so it is dropped)."""
    rows, count = values.shape
    device = values.device
    ranks = torch.arange(count, device=device).unsqueeze(0)
    ks = torch.tensor([p.top_k if p.top_k != -1 else count for p in params], device=device).unsqueeze(1)
    values = values.masked_fill(ranks >= ks, float("-inf"))
    top_ps = [p.top_p for p in params]
    if all(p >= 1.0 for p in top_ps):
        return values, torch.ones(rows, dtype=torch.bool, device=device)
    # Probabilities within what top-k kept: the candidates' own mass with top-k, the whole
    # row's without (its normalizer is one pass over the vocabulary, no sort).
    has_k = torch.tensor([p.top_k != -1 for p in params], device=device)
    log_norm = torch.where(has_k, values.logsumexp(dim=-1), scaled.logsumexp(dim=-1))
    probs = (values - log_norm.unsqueeze(1)).exp()
    cumulative = probs.cumsum(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it
    # already reaches p (the first token is always kept).
    p_column = torch.tensor(top_ps, dtype=probs.dtype, device=device).unsqueeze(1)
    values = values.masked_fill(cumulative - probs >= p_column, float("-inf"))
    return values, has_k | (cumulative[:, -1] >= p_column.squeeze(1))


def _weights(values: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each candidate's probability up to a per-row factor (the likeliest weighs 1), min_p
    applied: a token is dropped when its probability is under min_p times the likeliest's,
    which in these units is min_p itself. In place: values is the caller's own copy."""
    weights = values.sub_(values.max(dim=-1, keepdim=True).values).exp_()
    min_ps = [p.min_p for p in params]
    if any(min_ps):
        threshold = torch.tensor(min_ps, dtype=weights.dtype, device=weights.device).unsqueeze(1)
        weights.masked_fill_(weights < threshold, 0.0)
    return weights


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """For each row, the first column whose cumulative weight passes uniform * total: an exact
    categorical sample from one uniform number per row (a zero weight is never picked).

    In two levels, both summed in float64: blocks of CDF_BLOCK weights, then the block picked."""
    rows, count = weights.shape
    device = weights.device
    num_blocks = -(-count // CDF_BLOCK)
    if num_blocks * CDF_BLOCK != count:
        weights = torch.nn.functional.pad(weights, (0, num_blocks * CDF_BLOCK - count))
    blocks = weights.reshape(rows, num_blocks, CDF_BLOCK)
    block_cdf = blocks.sum(dim=-1).double().cumsum_(dim=-1)
    grand_total = block_cdf[:, -1]
    # Below the total even where uniform * total rounds up to it.
    target = torch.minimum(uniforms * grand_total,
                           torch.nextafter(grand_total, torch.zeros_like(grand_total)))
    block = _first_above(block_cdf, target)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_(min=0).unsqueeze(1)).squeeze(1),
                         torch.zeros_like(target))
    within = blocks[torch.arange(rows, device=device), block].double().cumsum_(dim=-1)
    # The block's mass summed again, in float64, may differ from its share of block_cdf by an
    # ulp: rescale the remainder to it, below its total.
    share = block_cdf.gather(1, block.unsqueeze(1)).squeeze(1) - before
    total = within[:, -1]
    remainder = ((target - before) / share * total).clamp_(min=0)
    remainder = torch.minimum(remainder, torch.nextafter(total, torch.zeros_like(total)))
    return block * CDF_BLOCK + _first_above(within, remainder)


def _first_above(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative value is above target (right bisection)."""
    found = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    return found.clamp_(max=cdf.shape[1] - 1)
