"""What speculation achieved (counters named as vLLM names them) and how many tokens to propose next.

SpecDecodeStats holds vLLM's counters: num_drafts (sequences that proposed at least one token in
a step), num_draft_tokens, num_accepted_tokens and num_accepted_tokens_per_pos (how often the
i-th proposed token was accepted). /metrics exports them as pagedllm:spec_decode_num_drafts,
pagedllm:spec_decode_num_draft_tokens, pagedllm:spec_decode_num_accepted_tokens and
pagedllm:spec_decode_num_accepted_tokens_per_pos{position="i"} (METRIC_NAMES).

choose_k is the adaptive rule; AcceptanceRate the recent acceptance rate it reads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

METRIC_PREFIX = "pagedllm:spec_decode_"
METRIC_NAMES = {name: METRIC_PREFIX + name for name in
                ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")}


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One sequence's step: it proposed num_draft_tokens, the first num_accepted_tokens stood."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(f"{num_accepted_tokens} accepted of {num_draft_tokens} proposed")
        if not num_draft_tokens:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted_tokens):
            per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed tokens (vLLM's draft acceptance rate)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a draft's step emitted on average: the accepted ones and the one after them."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.num_accepted_tokens_per_pos))

    def to_dict(self) -> dict:
        return {**asdict(self), "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length}


class AcceptanceRate:
    """The recent chance that a proposed token is accepted, if each is accepted independently with
    one chance a: a step that kept j of k proposals saw j acceptances and, if j < k, one rejection
    (the tokens after a rejection were never tested), so a = acceptances / (acceptances +
    rejections), both counted with older steps' weight decaying by `decay` per observation, and
    `prior` acceptances out of `prior_weight` tests added (where nothing is known yet, a = prior).

    A low rate turns speculation off (choose_k gives 0), and with it the observations that would
    raise the rate again; idle() moves the counts back toward the prior once per step without a
    proposal, so a sequence whose text starts repeating gets proposals again after a while."""

    def __init__(self, prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.9) -> None:
        if not 0 <= prior <= 1 or prior_weight <= 0 or not 0 < decay < 1:
            raise ValueError(f"need 0 <= prior <= 1, prior_weight > 0, 0 < decay < 1; got "
                             f"{prior}, {prior_weight}, {decay}")
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self._accepted = 0.0
        self._rejected = 0.0

    @property
    def value(self) -> float:
        weight = self._accepted + self._rejected + self.prior_weight
        return (self._accepted + self.prior * self.prior_weight) / weight

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if not num_draft_tokens:
            return
        self._accepted = self.decay * self._accepted + num_accepted_tokens
        self._rejected = self.decay * self._rejected + (num_accepted_tokens < num_draft_tokens)

    def idle(self) -> None:
        self._accepted *= self.decay
        self._rejected *= self.decay


# The cost of one more query token in a decode step, relative to the whole step, while the step
# is memory-bound (reading every weight once serves all its tokens). An estimate until part two
# of issue 34 measures it: with it a batch of 64 never speculates (64 x 0.02 > 1 makes even a sure
# proposal a loss), 16 streams speculate when proposals are mostly right, one stream nearly always.
TOKEN_COST = 0.02


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a step emits for a sequence that proposed k, each accepted with chance `acceptance`
    independently until the first rejection: 1 + a + a^2 + ... + a^k."""
    return sum(acceptance ** i for i in range(k + 1))


def choose_k(acceptance: float, batch_size: int, k_max: int, token_cost: float = TOKEN_COST) -> int:
    """How many tokens to propose, 0 to k_max: the k that makes the most tokens per unit of step
    time. A step's time is modelled as 1 + token_cost * batch_size * k (every one of the batch's
    sequences adds k query tokens), its output as expected_tokens(acceptance, k) per sequence.
    Small batches are memory-bound (more query tokens cost little), so k is large wherever
    proposals are often right; the batch's extra tokens weigh more as it grows, until the step is
    compute-bound and no k beats 0: speculation then only slows the step down. Ties go to the
    smaller k (fewer slots, less waste)."""
    if not 0 <= acceptance <= 1:
        raise ValueError(f"acceptance must be within [0, 1]; got {acceptance}")
    if batch_size < 1 or k_max < 0:
        raise ValueError(f"need batch_size >= 1 and k_max >= 0; got {batch_size}, {k_max}")
    best_k, best_rate = 0, 1.0
    for k in range(1, k_max + 1):
        rate = expected_tokens(acceptance, k) / (1 + token_cost * batch_size * k)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k
