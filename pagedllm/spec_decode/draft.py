"""The draft-model proposer: a smaller model with the target's tokenizer guesses the next k tokens
of every speculating sequence, in k small forward passes over all of them at once.

Its KV cache lives in the target's blocks (vLLM's way): the draft's layers get KV tensors of their
own, indexed by the same block ids, and a request's block table is the same list for both models.
A block thus holds the target's and the draft's K/V of the same tokens, and the budget is planned
with both in each block's bytes (the start-up line says how many are the draft's). Everything the
KV manager does to a request's blocks holds for its draft K/V with no bookkeeping of its own:
counted in memory_stats as the request's blocks, trimmed with them when proposals are rejected
(KVCacheManager.trim), freed with them when the request finishes, is aborted or preempted.

That is why the draft runs after the schedule (Speculator.fill), not before it: the scheduler
reserves slots for k placeholder tokens, allocate_slots gives the request its blocks for them
(copy-on-write first for a shared tail), and the draft then writes its K/V for the last accepted
token and its own proposals into those slots, and replaces the placeholders with its tokens
before the target runs them. The step's block copies are made in the draft's tensors too.

What the draft's K/V covers: `_computed[request]` positions, valid while they are accepted tokens,
so each step starts from min(that, the target's num_computed_tokens). Proposal x_j's K/V sits at
the position the target gives x_j, so an accepted prefix keeps its draft K/V and a rejected tail
is cut with the target's; a preempted request (its blocks gone) starts from nothing, and so does a
new one whose prompt hit the prefix cache (a cached block's draft layers may never have been
written: the draft catches up on the whole prompt, rewriting, into a block it shares, the K/V its
co-owners' drafts hold for the same tokens). Each step the draft first catches up on the tokens it
has not seen (the prompt, the tokens the target accepted or produced), in chunks of at most
max_num_batched_tokens, the last chunk giving x_1; then one pass per further proposed token.

A constrained request's draft proposes under its grammar: each position's draft logits are masked
by the grammar's state after the proposal so far (its matcher walked along and rolled back at the
end, as grammar.constrain_proposal does), so its tokens are ones the target may accept.

Sampling: a greedy request takes the draft's argmax; a sampled one draws from the draft's
distribution under the request's own settings (its penalties and token rules over the history
grown by the proposal so far, temperature, top-k, top-p, min-p: the sampler's
process_logits and sampling_probs) with its seeded generator where it has one, and hands that
distribution to the rejection sampler (q in min(1, p / q)). A seeded request thus takes k numbers
from its generator for the draft and k + 1 for the verification each step, and repeats run to run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from pagedllm.core.request import Request
from pagedllm.core.scheduler import ScheduledRequest
from pagedllm.spec_decode.rejection import _Extended
from pagedllm.structured.bitmask import allocate_token_bitmask, apply_token_bitmask_
from pagedllm.structured.matcher import GrammarMatcher
from pagedllm.worker.runner import ModelRunner
from pagedllm.worker.sampler import (
    Sampler,
    SamplingRow,
    _inverse_cdf,
    process_logits,
    sampling_probs,
    takes_argmax,
)

# What the scheduler reserves slots for until the draft has run (any valid id: never fed to a model).
PLACEHOLDER_TOKEN = 0


@dataclass
class DraftSequence:
    """A speculating sequence of this step, as the scheduler gave it slots."""

    request: Request
    num_tokens: int  # k: the placeholders the scheduler kept, the tokens to propose
    block_ids: list[int]  # the request's whole block table (the KV manager's live list)
    row: SamplingRow
    matcher: GrammarMatcher | None = None  # a constrained request's, standing after its accepted tokens


@dataclass
class DraftProposals:
    token_ids: list[list[int]]  # per sequence, its num_tokens proposed tokens
    # per sequence, [num_tokens, vocab] float32: the distribution each was drawn from; None for a
    # sequence that took the argmax (greedy: the rejection sampler reads no q for it)
    probs: list[torch.Tensor | None]


class _Tokens:
    """What the runner reads of a sequence: its id and tokens (accepted ones, then this step's
    proposal so far)."""

    def __init__(self, request_id: str, token_ids: list[int]) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self.spec_token_ids: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, sampler: Sampler, max_num_batched_tokens: int) -> None:
        """runner: the draft model's, its KV tensors as many blocks as the target's."""
        self.runner = runner
        self.sampler = sampler  # its generator serves unseeded requests
        self.max_num_batched_tokens = max_num_batched_tokens
        self._computed: dict[str, int] = {}  # request id -> positions whose draft K/V stand
        self._in_table: list[str] = []  # the requests the runner's block table has rows for

    def step_begins(self, block_copies: list[tuple[int, int]], preempted: Sequence[Request]) -> None:
        """The schedule's consequences for the draft's K/V: its copies-on-write made in the
        draft's tensors too, a preempted request's K/V gone with its blocks."""
        if block_copies:
            self.runner.copy_blocks(block_copies)
        for request in preempted:
            self._computed.pop(request.request_id, None)

    def forget(self, request_id: str) -> None:
        """The request ended: its blocks (and the draft K/V in them) went back with it."""
        self._computed.pop(request_id, None)
        self.runner.block_table.drop(request_id)

    @torch.inference_mode()
    def propose(self, batch: Sequence[DraftSequence]) -> DraftProposals:
        """Each sequence's num_tokens proposed tokens (and a sampled one's distributions), its
        K/V written into its slots up to the last proposed token, which the target's step runs."""
        # The target's block lists change under the draft between its runs (trim, copy-on-write,
        # preemption): its table rows are written afresh each step (a few ints per block).
        for request_id in self._in_table:
            self.runner.block_table.drop(request_id)
        self._in_table = [s.request.request_id for s in batch]
        seqs = [_Tokens(s.request.request_id, list(s.request.token_ids)) for s in batch]
        probs: list[list[torch.Tensor]] = [[] for _ in batch]
        walked = [0] * len(batch)  # tokens each grammar took, to roll back
        try:
            self._catch_up(batch, seqs, probs, walked)
            for j in range(1, max(s.num_tokens for s in batch)):
                going = [i for i, s in enumerate(batch) if s.num_tokens > j]
                self._run(batch, seqs, probs, [(i, 1, seqs[i].num_tokens - 1) for i in going], walked)
        finally:
            for s, n in zip(batch, walked):
                if n:
                    s.matcher.rollback(n)
        proposals = DraftProposals([], [])
        for s, seq, p in zip(batch, seqs, probs):
            num_known = s.request.num_tokens
            proposals.token_ids.append(seq.token_ids[num_known:])
            proposals.probs.append(torch.stack(p) if p else None)
            # K/V written: every position before the last proposed token's
            self._computed[s.request.request_id] = num_known + s.num_tokens - 1
        return proposals

    def _catch_up(self, batch: Sequence[DraftSequence], seqs: list[_Tokens],
                  probs: list[list[torch.Tensor]], walked: list[int]) -> None:
        """Run each sequence's tokens the draft has not seen, the last known one included (its
        logits give the first proposed token), in passes of at most max_num_batched_tokens."""
        starts = {i: min(self._computed.get(s.request.request_id, 0), s.request.num_computed_tokens)
                  for i, s in enumerate(batch)}
        while starts:
            budget, chunks = self.max_num_batched_tokens, []
            for i, start in starts.items():
                take = min(batch[i].request.num_tokens - start, budget)
                if take <= 0:
                    break
                chunks.append((i, take, start))
                budget -= take
            self._run(batch, seqs, probs, chunks, walked)
            for i, take, start in chunks:
                if start + take == batch[i].request.num_tokens:
                    del starts[i]
                else:
                    starts[i] = start + take

    def _run(self, batch: Sequence[DraftSequence], seqs: list[_Tokens], probs: list[list[torch.Tensor]],
             chunks: list[tuple[int, int, int]], walked: list[int]) -> None:
        """One draft pass over chunks (sequence, tokens, first position); each chunk that reaches
        its sequence's last token draws the next one, appended to it (and to its grammar's walk)."""
        block_size = self.runner.block_size
        scheduled = [ScheduledRequest(seqs[i], take, start, batch[i].block_ids, block_size)  # type: ignore[arg-type]
                     for i, take, start in chunks]
        sampling = [chunks[j][0] for j, s in enumerate(scheduled) if s.samples]
        argmax_only = all(takes_argmax(batch[i].row) and batch[i].matcher is None for i in sampling)
        result = self.runner.execute(scheduled, argmax_only)
        drawn = [chunks[j][0] for j in result.sample_indices]
        if argmax_only:
            tokens = result.logits.tolist()
        else:
            tokens = self._draw(batch, seqs, probs, drawn, self._masked(batch, drawn, result.logits))
        for i, token in zip(drawn, tokens):
            seqs[i].token_ids.append(token)
            matcher = batch[i].matcher
            if matcher is not None and not matcher.is_terminated:  # a completed grammar: cut in fill
                if not matcher.accept_token(token):  # drawn under its mask: the library disagrees
                    raise RuntimeError(f"the grammar refused token {token} its mask allowed: {matcher.error}")
                walked[i] += 1

    @staticmethod
    def _masked(batch: Sequence[DraftSequence], drawn: list[int], logits: torch.Tensor) -> torch.Tensor:
        """The logits with each constrained row masked by its grammar's current state."""
        constrained = [(j, batch[i].matcher) for j, i in enumerate(drawn)
                       if batch[i].matcher is not None and not batch[i].matcher.is_terminated]
        if not constrained:
            return logits
        logits = logits.float().clone()
        for j, matcher in constrained:
            mask = allocate_token_bitmask(1, matcher.vocab_size)
            matcher.fill_bitmask(mask, 0)
            apply_token_bitmask_(logits[j:j + 1], mask, matcher.vocab_size)
        return logits

    def _draw(self, batch: Sequence[DraftSequence], seqs: list[_Tokens], probs: list[list[torch.Tensor]],
              drawn: list[int], logits: torch.Tensor) -> list[int]:
        """Each row's token under its request's settings (the sampler's processing, over the
        history grown by this step's proposal so far); a sampled row's distribution kept."""
        rows = []
        for i in drawn:
            row = batch[i].row
            proposed = seqs[i].token_ids[batch[i].request.num_tokens:]
            rows.append(replace(row, history=_Extended(row.history, proposed)) if proposed else row)
        processed = process_logits(logits.float(), rows)
        dist = sampling_probs(processed, [r.params for r in rows])
        tokens = dist.argmax(dim=-1).tolist()  # a greedy row's mass is all on its argmax
        sampled = [j for j, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            device = dist.device
            uniforms = self.sampler.uniforms([rows[j].generator for j in sampled], device)
            index = torch.tensor(sampled, dtype=torch.long, device=device)
            for j, token in zip(sampled, _inverse_cdf(dist[index], uniforms).tolist()):
                tokens[j] = token
                probs[drawn[j]].append(dist[j])
        return tokens
