"""Speculative decoding in the engine core's step: proposals before the schedule, verification
after the model ran (the plan in pagedllm.spec_decode's docstring; the pieces are there).

- propose(): each running sequence whose next step is a decode gets up to k proposed tokens in
  request.spec_token_ids, k = choose_k(its recent acceptance rate, the running batch's size,
  num_speculative_tokens), capped so that the step cannot pass max_tokens or max_model_len. A
  constrained sequence's proposal is cut where its grammar refuses a token, and the grammar's
  mask of each position it verifies is kept for verify(). The scheduler may cut a proposal
  further (budget, blocks) before the step runs it.
- verify(): a sequence that ran k proposed tokens has k + 1 rows of logits; greedy ones keep the
  proposal's prefix that matches the argmax (from the argmax ids alone when the step gave only
  those), the others go through the rejection sampler, whose output distribution is the target's.
  Either way a run of accepted tokens and one more, with their logprobs where asked for.
- fill(): with a draft model, propose() only reserves: each proposal is k placeholders, the
  scheduler gives them slots, and fill() has the draft (pagedllm.spec_decode.draft) write its
  K/V into those slots and its tokens over the placeholders before the target runs them. A
  constrained sequence's draft proposes under its grammar's masks, and is cut where the grammar
  completes; the slots past the cut run anyway (the scheduler fixed the step) and verify() reads
  only the rows up to it.
- observe(): the counters (SpecDecodeStats, vLLM's names) and each sequence's AcceptanceRate.

Sequences that take a chooser's tokens (beam search) or still fan out (a prompt's first sample
of n) never speculate.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.engine.request_group import CoreSequence
from pagedllm.outputs import TokenLogprobs
from pagedllm.spec_decode import AcceptanceRate, SpecDecodeStats, SpeculativeConfig, choose_k, make_proposer
from pagedllm.spec_decode.draft import PLACEHOLDER_TOKEN, DraftModelProposer, DraftSequence
from pagedllm.spec_decode.grammar import constrain_proposal
from pagedllm.spec_decode.ngram import NgramBurst, NgramProposer
from pagedllm.spec_decode.rejection import Draft, RejectionSampler, accept_greedy
from pagedllm.structured.bitmask import apply_token_bitmask_
from pagedllm.worker.sampler import Sampler

# A sequence's run this step: its tokens (accepted proposal tokens, then one more) and their
# logprobs (None where not asked for).
Run = tuple[list[int], list[TokenLogprobs | None]]


class Speculator:
    def __init__(self, config: SpeculativeConfig, sampler: Sampler, max_model_len: int,
                 draft: DraftModelProposer | None = None) -> None:
        """draft: the draft model's proposer (method draft_model), else None."""
        self.config = config
        self.draft = draft
        self.proposer = make_proposer(config) if draft is None else None
        self.verifier = RejectionSampler(sampler)
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()
        self._rates: dict[str, AcceptanceRate] = {}
        # The grammar masks of this step's constrained proposals ([k + 1, words]), by request id.
        self._masks: dict[str, torch.Tensor] = {}
        # A draft model's, by request id: the proposal's tokens its grammar keeps (absent: all),
        # and the distributions a sampled request's were drawn from ([k, vocab]).
        self._kept: dict[str, int] = {}
        self._draft_probs: dict[str, torch.Tensor] = {}

    # -- before the schedule ---------------------------------------------------------------------
    def propose(self, running: Sequence[Request], seqs: dict[str, CoreSequence]) -> None:
        """Proposals for the running sequences whose next step is a decode."""
        self._masks.clear()
        self._kept.clear()
        self._draft_probs.clear()
        candidates = [seqs[r.request_id] for r in running if self._decodes_next(r, seqs)]
        if not candidates:
            return
        ks = [self._k(seq.request, len(running)) for seq in candidates]
        if self.draft is not None:  # slots first: the draft writes its K/V into them (fill)
            proposals = [[PLACEHOLDER_TOKEN] * k for k in ks]
        else:
            proposals = self.proposer.propose([seq.request for seq in candidates], ks)
        for seq, proposal in zip(candidates, proposals):
            if proposal and seq.matcher is not None and self.draft is None:
                proposal, mask = constrain_proposal(seq.matcher, proposal)
                self._masks[seq.request.request_id] = mask
            seq.request.spec_token_ids = list(proposal)
            if not proposal:
                self._rate(seq.request.request_id).idle()

    @property
    def proposes_in_bursts(self) -> bool:
        """Whether decode bursts may run with this speculation in their steps: the n-gram rule,
        which the burst's compiled call applies itself (pagedllm.engine.decode_burst)."""
        return isinstance(self.proposer, NgramProposer)

    def burst(self, running: Sequence[Request]) -> NgramBurst:
        """The n-gram settings of a decode burst over the running sequences: each one's k as a
        step of them all would choose it (the burst caps it further by its slots left)."""
        ks = {r.request_id: self._k(r, len(running)) for r in running}
        histories = {r.request_id: self.proposer.tokens_of(r) for r in running}
        return NgramBurst(ks, self.proposer.min_n, self.proposer.max_n, histories)

    @staticmethod
    def _decodes_next(request: Request, seqs: dict[str, CoreSequence]) -> bool:
        seq = seqs.get(request.request_id)
        return (seq is not None and request.status is RequestStatus.RUNNING
                and request.num_computed_tokens == request.num_tokens - 1 and seq.group.fan_out == 1)

    def _k(self, request: Request, batch_size: int) -> int:
        """Tokens to propose: choose_k's, capped so that the step emits (k + 1 tokens at most)
        neither past max_tokens nor past max_model_len."""
        params = request.sampling_params
        k = choose_k(self._rate(request.request_id).value, batch_size, self.config.num_speculative_tokens)
        k = min(k, self.max_model_len - request.num_tokens)
        if params.max_tokens is not None:
            k = min(k, params.max_tokens - request.num_output_tokens - 1)
        return max(k, 0)

    def _rate(self, request_id: str) -> AcceptanceRate:
        rate = self._rates.get(request_id)
        if rate is None:
            rate = self._rates[request_id] = AcceptanceRate()
        return rate

    # -- after the schedule ----------------------------------------------------------------------
    def fill(self, out: SchedulerOutput, seqs: dict[str, CoreSequence]) -> None:
        """A draft model's proposals over the placeholders the scheduler kept (k of them each),
        its K/V written into the slots it gave them. Nothing to do for the other methods."""
        if self.draft is None:
            return
        self.draft.step_begins(out.block_copies, out.preempted)
        items = [s for s in out.scheduled if s.num_spec_tokens]
        if not items:
            return
        batch = [DraftSequence(s.request, s.num_spec_tokens, s.block_ids, seq.row, seq.matcher)
                 for s in items for seq in (seqs[s.request.request_id],)]
        proposals = self.draft.propose(batch)
        for s, tokens, probs in zip(items, proposals.token_ids, proposals.probs):
            request_id, seq = s.request.request_id, seqs[s.request.request_id]
            s.request.spec_token_ids[:] = tokens
            if probs is not None:
                self._draft_probs[request_id] = probs
            if seq.matcher is not None:
                kept, self._masks[request_id] = constrain_proposal(seq.matcher, tokens)
                self._kept[request_id] = len(kept)

    # -- after the model ran ---------------------------------------------------------------------
    def verify(self, seqs: list[CoreSequence], counts: list[int], logits: torch.Tensor,
               argmax_only: bool) -> list[Run]:
        """Each speculating sequence's run, from its counts[i] = k + 1 rows of logits (laid end
        to end in `logits`; with argmax_only, the rows' argmax ids)."""
        logits, counts = self._kept_rows(seqs, counts, logits)
        if argmax_only:
            ids = logits.tolist()
            runs, start = [], 0
            for seq, n in zip(seqs, counts):
                tokens = accept_greedy(ids[start:start + n], seq.request.spec_token_ids[:n - 1])
                runs.append((tokens, [None] * len(tokens)))
                start += n
            return runs
        logits = self._masked(seqs, counts, logits)
        drafts = [self._draft(seq, n) for seq, n in zip(seqs, counts)]
        out = self.verifier(logits, drafts)
        return [(tokens, lps if lps is not None else [None] * len(tokens))
                for tokens, lps in zip(out.token_ids, out.logprobs)]

    def _draft(self, seq: CoreSequence, num_rows: int) -> Draft:
        """What the rejection sampler verifies for seq: its proposal's first num_rows - 1 tokens,
        with the distributions a draft model drew them from (None for the other methods)."""
        proposal = seq.request.spec_token_ids[:num_rows - 1]
        probs = self._draft_probs.get(seq.request.request_id)
        return Draft(seq.row, proposal, None if probs is None else probs[:len(proposal)])

    def _kept_rows(self, seqs: list[CoreSequence], counts: list[int],
                   logits: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """The rows up to where each draft proposal's grammar cut it (fill), and their counts."""
        kept = [min(n, self._kept.get(seq.request.request_id, n) + 1) for seq, n in zip(seqs, counts)]
        if kept == counts:
            return logits, counts
        rows, start = [], 0
        for n, k in zip(counts, kept):
            rows.extend(range(start, start + k))
            start += n
        return logits[torch.tensor(rows, dtype=torch.long, device=logits.device)], kept

    def _masked(self, seqs: list[CoreSequence], counts: list[int], logits: torch.Tensor) -> torch.Tensor:
        """The logits with each constrained sequence's rows masked by its grammar's states along
        its proposal (the masks propose() kept)."""
        masked = [(i, self._masks[seq.request.request_id]) for i, seq in enumerate(seqs)
                  if seq.matcher is not None]
        if not masked:
            return logits
        logits = logits.float()
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        vocab_size = seqs[masked[0][0]].matcher.vocab_size
        for i, mask in masked:
            rows = logits[starts[i]:starts[i + 1]]
            apply_token_bitmask_(rows, mask[:counts[i]].contiguous(), vocab_size)
        return logits

    def observe(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        num_proposed = min(num_proposed, self._kept.get(request_id, num_proposed))
        self.stats.observe(num_proposed, num_accepted)
        self._rate(request_id).observe(num_proposed, num_accepted)

    def observe_step(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """One step of a decode burst's (pagedllm.engine.decode_burst): counted as a step of its
        own, a step without a proposal as propose() counts one."""
        if num_proposed:
            self.observe(request_id, num_proposed, num_accepted)
        else:
            self._rate(request_id).idle()

    def forget(self, request_id: str) -> None:
        """The sequence ended: drop what was kept for it."""
        self._rates.pop(request_id, None)
        (self.draft or self.proposer).forget(request_id)
