"""N-gram prompt lookup: propose what followed the sequence's latest tokens the last time they
appeared in it (prompt or output).

The rule, for a sequence t[0..L) and lengths min <= max: the match length n is the largest in
[min, max] for which the last n tokens t[L-n..L) also occur ending at an earlier position e < L-1;
among the occurrences of that longest match, the most recent (largest e) wins. The proposal is
what followed it, t[e+1], t[e+2], ..., read periodically when it runs into the sequence's end:
the match means the text repeats with period p = L-1-e, so token L+i is t[L-p + i mod p]
(vLLM's lookup stops at the end instead; "a a a a" then proposes one token, here k).

Cost: one comparison of the last token against the whole sequence (numpy, ~L/1000 µs), then
comparisons on the few candidates left, per extra match token. The sequence's tokens live in a
TokenIndex that only appends what is new. `pagedllm bench proposers` measures a call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pagedllm.spec_decode.proposer import SequenceTokens, TokenIndex, check_max_tokens


@dataclass(frozen=True)
class NgramBurst:
    """The rule inside a decode burst (pagedllm.engine.decode_burst), where the compiled call
    (csrc/decode_burst.cpp, the same rule) proposes before each of its steps: the most tokens each
    sequence may propose a step, by request id, and the match lengths."""
    ks: Mapping[str, int]
    lookup_min: int
    lookup_max: int
    # Each sequence's tokens (prompt and output) as int64, by request id: NgramProposer.tokens_of's
    # arrays, which only append what is new (a copy of a long context's list each burst would not).
    histories: Mapping[str, np.ndarray]


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max; got "
                             f"{prompt_lookup_min}, {prompt_lookup_max}")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._indexes: dict[str, TokenIndex] = {}

    def propose(self, sequences: Sequence[SequenceTokens], max_tokens: Sequence[int]) -> list[list[int]]:
        check_max_tokens(sequences, max_tokens)
        proposals = []
        for seq, k in zip(sequences, max_tokens):
            if k <= 0:
                proposals.append([])
                continue
            proposals.append(lookup(self.tokens_of(seq), self.min_n, self.max_n, k))
        return proposals

    def tokens_of(self, seq: SequenceTokens) -> np.ndarray:
        """seq's tokens as an int64 array, kept from call to call (only what is new is added)."""
        index = self._indexes.get(seq.request_id)
        if index is None:
            index = self._indexes[seq.request_id] = TokenIndex()
        return index.sync(seq.token_ids)

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)


def lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The proposal of at most k tokens for one sequence (the module's rule); [] without a match."""
    length = tokens.shape[0]
    if length < min_n + 1 or k <= 0:
        return []
    # Ends of earlier occurrences of the last token: positions e < L-1 with t[e] == t[L-1].
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
    match_len = 1
    best = ends
    # Grow the match one token to the left while some candidates still agree: `ends` keeps the
    # candidates matching match_len tokens; the last non-empty set is the longest match.
    while ends.size and match_len < max_n and match_len < length - 1:
        ends = ends[ends >= match_len]
        ends = ends[tokens[ends - match_len] == tokens[length - 1 - match_len]]
        if ends.size:
            match_len += 1
            best = ends
    if not best.size or match_len < min_n:
        return []
    end = int(best[-1])  # the most recent occurrence of the longest match
    period = length - 1 - end
    positions = length - period + np.arange(k) % period
    return tokens[positions].tolist()
