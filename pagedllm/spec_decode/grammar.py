"""Structured outputs under speculation: a constrained sequence's proposal is cut at the first
token its grammar refuses, and each verified position gets the mask of the grammar's state there.

The sequence's matcher stands after its accepted tokens. Walking it through the proposal gives,
before each proposed token, the tokens allowed at that position: the rows of a bitmask for the
k + 1 positions the step verifies (the last is the state after the whole proposal). The walk is
rolled back at the end, so the matcher is as it was; after verification the engine advances it by
the tokens emitted, as it does a sampled token now. A proposal token the grammar refuses ends the
proposal there (no position after it could be valid), and so does a grammar that completes.
"""

from __future__ import annotations

import torch

from pagedllm.structured.bitmask import allocate_token_bitmask
from pagedllm.structured.matcher import GrammarMatcher


def constrain_proposal(matcher: GrammarMatcher, proposal: list[int]) -> tuple[list[int], torch.Tensor]:
    """The longest prefix of `proposal` the grammar accepts, and the bitmask (rows: one per
    position to verify, len(prefix) + 1) of what it allows at each; the matcher left unchanged.
    A token is tested against the mask before the matcher sees it: a refused one would put the
    matcher in error."""
    bitmask = allocate_token_bitmask(len(proposal) + 1, matcher.vocab_size)
    kept = 0
    matcher.fill_bitmask(bitmask, 0)
    for token in proposal:
        if matcher.is_terminated or not _allows(bitmask[kept], token, matcher.vocab_size):
            break
        if not matcher.accept_token(token):  # the mask allowed it: the library disagrees with itself
            raise RuntimeError(f"the grammar refused token {token} its mask allowed: {matcher.error}")
        kept += 1
        matcher.fill_bitmask(bitmask, kept)
    matcher.rollback(kept)
    return proposal[:kept], bitmask[:kept + 1]


def _allows(row: torch.Tensor, token: int, vocab_size: int) -> bool:
    return 0 <= token < vocab_size and bool((int(row[token >> 5]) >> (token & 31)) & 1)
