"""What every proposer offers the engine, and what it reads of a sequence.

A proposer guesses the next tokens of a batch of sequences from plain ints: it never sees logits
or the KV cache (a draft model keeps its own, pagedllm.spec_decode.draft). Proposers that index a
sequence's tokens keep that index from step to step and only add what was appended since
(TokenIndex), so a step's cost does not grow with the context; forget() drops a finished
sequence's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class SequenceTokens(Protocol):
    """A sequence as a proposer reads it (pagedllm.core.request.Request is one): its id and its
    tokens, prompt then accepted output, a list that only grows."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int


class Proposer(Protocol):
    def propose(self, sequences: Sequence[SequenceTokens], max_tokens: Sequence[int]) -> list[list[int]]:
        """For each sequence, at most max_tokens[i] tokens guessed to follow it (maybe none)."""
        ...

    def forget(self, request_id: str) -> None:
        """The sequence finished, was aborted or is gone: drop what was kept for it."""
        ...


class TokenIndex:
    """A sequence's tokens as a numpy array that grows with it: appending what is new costs
    O(new tokens), where converting the whole list each step would cost O(context)."""

    def __init__(self) -> None:
        self._buffer = np.empty(256, dtype=np.int64)
        self.length = 0

    @property
    def tokens(self) -> np.ndarray:
        return self._buffer[:self.length]

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """Bring the array up to token_ids (which must extend what was synced before: a sequence
        only grows; anything else is rebuilt)."""
        n = len(token_ids)
        if n < self.length or (self.length and token_ids[self.length - 1] != self._buffer[self.length - 1]):
            self.length = 0
        if n > self._buffer.shape[0]:
            grown = np.empty(max(n, 2 * self._buffer.shape[0]), dtype=np.int64)
            grown[:self.length] = self._buffer[:self.length]
            self._buffer = grown
        if n > self.length:
            self._buffer[self.length:n] = token_ids[self.length:n]
            self.length = n
        return self.tokens


def check_max_tokens(sequences: Sequence[SequenceTokens], max_tokens: Sequence[int]) -> None:
    if len(max_tokens) != len(sequences):
        raise ValueError(f"{len(max_tokens)} proposal lengths for {len(sequences)} sequences")
