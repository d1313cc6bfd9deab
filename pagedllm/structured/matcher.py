"""One sequence's place in its grammar: advanced with every accepted token, asked for the mask
of tokens allowed next.

The engine keeps one matcher per sequence (n > 1 and beam children each fork their own), and
feeds it exactly the tokens the sequence keeps. Preemption by recompute keeps the output tokens,
so the matcher stays valid; where state must be rebuilt (a new process, a restored request),
replay() walks the same tokens again. EOS is one of the grammar's tokens: a mask allows it only
where the grammar may end (can_end), and once the grammar is complete nothing else is allowed
(is_terminated), so the engine finishes the sequence there.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch

from pagedllm.structured.bitmask import allocate_token_bitmask, allowed_ids


class GrammarMatcher:
    def __init__(self, template: llguidance.LLMatcher, vocab_size: int,
                 state: llguidance.LLMatcher | None = None):
        # The compiled grammar's pristine matcher, shared and never advanced: reset copies it
        # again (llguidance's own reset keeps an error state, a copy does not).
        self._template = template
        self._matcher = state if state is not None else template.deep_copy()
        self.vocab_size = vocab_size  # the tokenizer's: ids at or past it are never allowed
        self.num_tokens = 0  # tokens accepted since the start (what rollback may undo)

    # -- advancing ----------------------------------------------------------------------------
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token. False if the grammar does not allow it: the matcher is
        then in error until reset (error says why), and the engine should end the sequence."""
        if not self._matcher.consume_token(token_id):  # an id past the vocabulary included
            return False
        self.num_tokens += 1
        return True

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance by each token in turn; False at the first one refused."""
        return all(self.accept_token(t) for t in token_ids)

    def replay(self, token_ids: Sequence[int]) -> bool:
        """Back to the start, then accept token_ids: the state a sequence with these output
        tokens has (after a restore, or to check a stored output)."""
        self.reset()
        return self.accept_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (for a draft token a verifier rejected)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} tokens; {self.num_tokens} accepted")
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback failed: {self._matcher.get_error()}")
        self.num_tokens -= num_tokens

    def reset(self) -> None:
        self._matcher = self._template.deep_copy()
        self.num_tokens = 0

    def fork(self) -> GrammarMatcher:
        """An independent copy in the same state (a child of n > 1 or a beam)."""
        child = GrammarMatcher(self._template, self.vocab_size, self._matcher.deep_copy())
        child.num_tokens = self.num_tokens
        return child

    # -- asking -------------------------------------------------------------------------------
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (bit i of word j: token 32*j + i).
        A matcher in error allows nothing but EOS; a terminated one only EOS."""
        # llguidance.torch's helper is this call; importing that module costs torch._dynamo
        # (2-4 s of every start-up), for a decorator on a function we never call.
        words = bitmask[row]
        assert words.dtype == torch.int32 and words.is_cpu and words.is_contiguous()
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def allowed_token_ids(self) -> list[int]:
        """The allowed next tokens as ids (one mask computed; for checks, not for the hot path)."""
        bitmask = allocate_token_bitmask(1, self.vocab_size)
        self.fill_bitmask(bitmask, 0)
        return allowed_ids(bitmask[0], self.vocab_size)

    @property
    def can_end(self) -> bool:
        """The grammar may end here: EOS is allowed."""
        return self._matcher.is_accepting()

    @property
    def is_terminated(self) -> bool:
        """Nothing but EOS can follow (the grammar is complete, EOS was taken, or an error)."""
        return self._matcher.is_stopped()  # true in error too

    @property
    def error(self) -> str | None:
        """Why the matcher refused a token (it then stays in error until reset)."""
        return self._matcher.get_error() or None

    @property
    def fills_own_row(self) -> bool:
        """Its mask is its own now, not its llguidance matcher's (a thinking budget forcing the
        end marker: reasoning_budget.py): the batched fill must ask it."""
        return False

    @property
    def handle(self) -> llguidance.LLMatcher:
        """The library's matcher, for the batched mask fill (bitmask.py)."""
        return self._matcher


class BitmaskFiller:
    """Fills the rows of a step's bitmask from its matchers: a loop, or with num_threads > 1 and
    a batch of at least MIN_PARALLEL, one call into llguidance's thread pool (no GIL while it
    works). On the 2-core machine the loop won (at 16 matchers 0.6 ms against 4-8 ms through the
    pool, at 64 equal within noise: the pool's threads wait behind the model's), so it is the
    default; a machine with idle cores should pass num_threads."""

    MIN_PARALLEL = 8

    def __init__(self, num_threads: int = 1):
        if num_threads < 1:
            raise ValueError(f"num_threads must be at least 1; got {num_threads}")
        self._executor = llguidance.LLExecutor(num_threads) if num_threads > 1 else None

    def fill(self, bitmask: torch.Tensor, matchers: Sequence[tuple[GrammarMatcher, int]]) -> None:
        """Write each matcher's allowed tokens into its row: (matcher, row) pairs."""
        if self._executor is None or len(matchers) < self.MIN_PARALLEL:
            for matcher, row in matchers:
                matcher.fill_bitmask(bitmask, row)
            return
        for matcher, row in matchers:
            if matcher.fills_own_row:
                matcher.fill_bitmask(bitmask, row)
        matchers = [(m, row) for m, row in matchers if not m.fills_own_row]
        if not matchers:
            return
        # As llguidance.torch.fill_next_token_bitmask_par, without importing that module (see
        # GrammarMatcher.fill_bitmask).
        assert bitmask.dtype == torch.int32 and bitmask.is_cpu and bitmask.is_contiguous()
        rows, words = bitmask.shape
        self._executor.unsafe_compute_mask_ptr([(m.handle, row) for m, row in matchers],
                                               bitmask.data_ptr(), words * 4, rows)
