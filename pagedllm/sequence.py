"""Per-sequence output state: incremental text, stop strings, logprobs, the seeded generator."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.outputs import CompletionOutput, Logprob
from pagedllm.request import Request, RequestStatus
from pagedllm.sampler import TokenLogprobs


@dataclass
class SequenceState:
    request: Request
    index: int  # position among the n outputs of its user request
    detokenizer: object  # pagedllm.tokenizer.IncrementalDetokenizer
    generator: torch.Generator | None
    stop: list[str]
    include_stop: bool
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    stop_reason: str | int | None = None
    finish_reason: str | None = None
    _stop_holdback: int = field(init=False)

    def __post_init__(self) -> None:
        # While running, hold back enough text that a stop string still being typed is never shown.
        self._stop_holdback = max((len(s) for s in self.stop), default=1) - 1

    def add_token(self, token_id: int, logprobs: TokenLogprobs | None, decode_one) -> bool:
        """Append a token's text. Returns True when a stop string ended the sequence."""
        delta = self.detokenizer.add(token_id)
        if logprobs is not None:
            self._add_logprobs(logprobs, decode_one)
        if not delta:
            return False
        search_from = max(0, len(self.text) - self._stop_holdback)
        self.text += delta
        for stop in self.stop:
            at = self.text.find(stop, search_from)
            if at != -1:
                self.text = self.text[:at + (len(stop) if self.include_stop else 0)]
                self.stop_reason = stop
                return True
        return False

    def _add_logprobs(self, lp: TokenLogprobs, decode_one) -> None:
        if self.logprobs is None:
            self.logprobs = []
        entry = {tid: Logprob(val, rank, decode_one(tid)) for rank, (tid, val) in enumerate(lp.top, 1)}
        entry[lp.token_id] = Logprob(lp.logprob, lp.rank, decode_one(lp.token_id))
        self.logprobs.append(entry)
        self.cumulative_logprob += lp.logprob

    def finish(self, status: RequestStatus) -> None:
        if not isinstance(self.stop_reason, str):
            # Text held back for an unfinished UTF-8 character is final now.
            self.text += self.detokenizer.flush()
        self.finish_reason = status.value
        if self.stop_reason is None:
            self.stop_reason = self.request.stop_reason  # the stop token id, if one ended it

    def to_output(self) -> CompletionOutput:
        finished = self.finish_reason is not None
        visible = self.text if finished or not self._stop_holdback else \
            self.text[:max(0, len(self.text) - self._stop_holdback)]
        return CompletionOutput(
            index=self.index, text=visible, token_ids=list(self.request.output_token_ids),
            finish_reason=self.finish_reason, stop_reason=self.stop_reason,
            logprobs=self.logprobs,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None)
