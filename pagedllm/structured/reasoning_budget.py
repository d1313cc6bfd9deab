"""A thinking budget: a grammar matcher that counts the reasoning's tokens and, once the budget is
spent, forces the reasoning's end marker (the `thinking_token_budget` of vLLM's API).

The matcher follows the answer as it is generated: where the reasoning starts (mode "open": at
once; "optional": if the answer opens with the start marker), how many tokens it took, and
whether the end marker came. At the budget, while the marker has not come, the mask allows only
the marker's next token (its canonical tokenization; if the reasoning's last tokens were the
beginning of the marker, only the rest of it), one per step, and then the grammar goes on as
before: the reasoning grammar (reasoning_grammar.py) reads the forced marker as the end of the
reasoning. The tokens that open the reasoning are not counted; the model's own end marker is.

Its state is a few numbers and the answer's last bytes, kept per token so that rollback (a
rejected speculative token) restores it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import llguidance
import torch

from pagedllm.structured.matcher import GrammarMatcher
from pagedllm.structured.spec import ReasoningPrefix


@dataclass(frozen=True)
class _BudgetState:
    phase: str  # "start" (undecided) | "reasoning" | "forcing" | "done" (the answer)
    tail: bytes = b""  # the answer's last bytes while they may still hold a marker
    count: int = 0  # reasoning tokens so far
    forced: tuple[int, ...] = ()  # the marker's tokens still to force


class ReasoningBudgetMatcher(GrammarMatcher):
    def __init__(self, template: llguidance.LLMatcher, vocab_size: int, prefix: ReasoningPrefix,
                 tokenizer: llguidance.LLTokenizer, state: llguidance.LLMatcher | None = None):
        super().__init__(template, vocab_size, state)
        if prefix.budget is None:
            raise ValueError("a reasoning budget matcher needs a budget")
        self._prefix = prefix
        self._tokenizer = tokenizer
        self._start = prefix.start.encode()
        self._end = prefix.end.encode()
        self._state = self._initial()
        self._history: list[_BudgetState] = []  # the state before each accepted token
        self._refusal: str | None = None  # why a token was refused while forcing the marker

    def _initial(self) -> _BudgetState:
        return _BudgetState("reasoning" if self._prefix.mode == "open" else "start")

    # -- advancing ----------------------------------------------------------------------------
    def accept_token(self, token_id: int) -> bool:
        if self._state.phase == "forcing" and token_id != self._state.forced[0]:
            self._refusal = (f"the thinking budget is spent: only the end marker's token "
                             f"{self._state.forced[0]} may come, not {token_id}")
            return False
        if not super().accept_token(token_id):
            return False
        self._history.append(self._state)
        self._state = self._next(self._state, token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        super().rollback(num_tokens)
        if num_tokens:
            self._state = self._history[-num_tokens]
            del self._history[-num_tokens:]

    def reset(self) -> None:
        super().reset()
        self._state = self._initial()
        self._history = []
        self._refusal = None

    def fork(self) -> ReasoningBudgetMatcher:
        child = ReasoningBudgetMatcher(self._template, self.vocab_size, self._prefix, self._tokenizer,
                                       self._matcher.deep_copy())
        child.num_tokens = self.num_tokens
        child._state = self._state
        child._history = list(self._history)
        return child

    def _next(self, state: _BudgetState, token_id: int) -> _BudgetState:
        if state.phase == "done":
            return state
        tail = state.tail + self._tokenizer.decode_bytes([token_id])
        if state.phase == "start":
            stripped = tail.lstrip()
            if stripped.startswith(self._start):
                return self._reasoning(_BudgetState("reasoning"), stripped[len(self._start):], 0)
            return replace(state, tail=tail) if self._start.startswith(stripped) else _BudgetState("done")
        if state.phase == "forcing":
            return self._reasoning(replace(state, forced=state.forced[1:]), tail, state.count)
        return self._reasoning(state, tail, state.count + 1)

    def _reasoning(self, state: _BudgetState, tail: bytes, count: int) -> _BudgetState:
        """The state after reasoning text ending in tail, count tokens of it."""
        if self._end in tail or (state.phase == "forcing" and not state.forced):
            return _BudgetState("done")
        tail = tail[-(len(self._end) - 1):] if len(self._end) > 1 else b""
        if state.phase == "forcing" or count < self._prefix.budget:
            return replace(state, tail=tail, count=count)
        return _BudgetState("forcing", tail, count, tuple(self._marker_tokens(tail)))

    def _marker_tokens(self, tail: bytes) -> list[int]:
        """The tokens that close the reasoning after tail: the marker, or its rest where tail ends
        with its beginning."""
        for length in range(min(len(tail), len(self._end) - 1), 0, -1):
            if self._end.startswith(tail[-length:]):
                return self._tokenizer.tokenize_bytes(self._end[length:])
        return self._tokenizer.tokenize_bytes(self._end)

    # -- asking -------------------------------------------------------------------------------
    @property
    def fills_own_row(self) -> bool:
        return self._state.phase == "forcing"

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._state.phase != "forcing":
            super().fill_bitmask(bitmask, row)
            return
        token = self._state.forced[0]
        words = bitmask[row]
        words.zero_()
        bit = token % 32
        words[token // 32] = (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32: bit 31 is the sign

    @property
    def error(self) -> str | None:
        return self._refusal or super().error

    @property
    def can_end(self) -> bool:
        return self._state.phase != "forcing" and super().can_end

    @property
    def is_terminated(self) -> bool:
        return self._state.phase != "forcing" and super().is_terminated
