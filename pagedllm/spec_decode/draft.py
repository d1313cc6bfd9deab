"""The draft-model proposer's interface; its implementation (a small model with the target's
tokenizer, its own paged KV in the target's block pool) comes with the integration.

Unlike the n-gram and suffix proposers, a draft model runs a model: it proposes for the whole
batch at once, k forward steps over every speculating sequence's last tokens, and hands back the
distribution each proposed token was drawn from, which the rejection sampler needs for sampled
requests (q in min(1, p/q)). Its KV blocks come from the same pool as the target's, counted for
the request and freed with it; a rejected proposal's draft K/V is trimmed like the target's
(KVCacheManager.trim). check_draft_vocabulary (pagedllm.spec_decode.config) refuses a draft with
another vocabulary at start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedllm.spec_decode.proposer import SequenceTokens


@dataclass
class DraftProposals:
    token_ids: list[list[int]]  # per sequence, at most its max_tokens proposed tokens
    # per sequence, [len(token_ids[i]), vocab] float32: the distribution each was drawn from
    # (a greedy request's: all on the token); what RejectionSampler's Draft.draft_probs takes
    probs: list[torch.Tensor]


class DraftProposer(Protocol):
    def propose(self, sequences: Sequence[SequenceTokens], max_tokens: Sequence[int]) -> DraftProposals:
        """Proposals for the batch: the draft model continues each sequence from its last tokens
        (its own KV holds the rest) by up to max_tokens[i] tokens, sampling as the request does."""
        ...

    def forget(self, request_id: str) -> None:
        """The request is gone: its draft KV blocks go back to the pool."""
        ...
