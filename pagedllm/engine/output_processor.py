"""The output processor: from the core's new token ids to what a user sees.

It owns the text: incremental detokenization, stop strings, log-probability dicts with decoded
tokens, and the RequestOutputs, in the kind each request asked for (SamplingParams.output_kind):
CUMULATIVE (everything so far), DELTA (only what is new since the last output) or FINAL_ONLY.
Per token it appends (token ids, text pieces); it never copies a whole output to make a step's
answer, so its cost does not grow with the output's length: CUMULATIVE outputs hand out the
sequence's own token and logprob lists (they keep growing while the request runs) and join the
text when they are built.

A stop string finishes its sequence here, the moment its text appears; process_outputs then
names the sequences the core must abort, since the core never sees text. Text that could still
grow into a stop string is held back until it cannot.

The token that stopped a sequence in the core (an EOS id, or one of stop_token_ids) stays in its
token ids but gives no text unless include_stop_str_in_output (vLLM's rule): with
skip_special_tokens off, an answer would otherwise end in `<|eos|>` or gpt-oss's `<|return|>`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedllm.engine.messages import EngineCoreOutput, EngineCoreRequest
from pagedllm.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
)
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.text.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput | PoolingRequestOutput]
    # (request id, index) of each sequence a stop string finished: the core must abort them.
    sequences_to_abort: list[tuple[str, int]] = field(default_factory=list)


@dataclass(eq=False)
class _SequenceText:
    """One output sequence of a request: its tokens, its text, and what was handed out."""

    index: int
    detokenizer: IncrementalDetokenizer
    stop: list[str]
    include_stop: bool
    holdback: int  # trailing characters that could still start a stop string
    token_ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # the visible text, in pieces
    pending: str = ""  # text held back: it may be the start of a stop string
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # What earlier outputs handed out (DELTA): token and piece counts, and the end.
    num_tokens_sent: int = 0
    num_pieces_sent: int = 0
    finish_sent: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add_text(self, delta: str) -> bool:
        """Append a token's text. True when a stop string ended the sequence (the text is cut
        there, or just after it with include_stop)."""
        window = self.pending + delta
        for stop in self.stop:
            at = window.find(stop)
            if at != -1:
                self._show(window[:at + (len(stop) if self.include_stop else 0)])
                self.pending = ""
                self.finish_reason, self.stop_reason = "stop", stop
                return True
        keep = min(self.holdback, len(window))
        self._show(window[:len(window) - keep])
        self.pending = window[len(window) - keep:]
        return False

    def finish(self, reason: str, stop_reason: int | None) -> None:
        # Text held back (a possible stop string, an unfinished UTF-8 character) is final now.
        self._show(self.pending + self.detokenizer.flush())
        self.pending = ""
        self.finish_reason, self.stop_reason = reason, stop_reason

    def _show(self, text: str) -> None:
        if text:
            self.pieces.append(text)

    @property
    def has_news(self) -> bool:
        """New text since the last DELTA output, or the end."""
        return len(self.pieces) > self.num_pieces_sent or (self.finished and not self.finish_sent)

    def output(self, delta: bool) -> CompletionOutput:
        """What is new since the last delta; or everything, its lists the sequence's own."""
        if delta:
            tokens = self.token_ids[self.num_tokens_sent:]
            logprobs = None if self.logprobs is None else self.logprobs[self.num_tokens_sent:]
            text = "".join(self.pieces[self.num_pieces_sent:])
            self.num_tokens_sent, self.num_pieces_sent = len(self.token_ids), len(self.pieces)
            self.finish_sent = self.finished
        else:
            tokens, logprobs, text = self.token_ids, self.logprobs, "".join(self.pieces)
        return CompletionOutput(
            index=self.index, text=text, token_ids=tokens, finish_reason=self.finish_reason,
            stop_reason=self.stop_reason, logprobs=logprobs,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None)


@dataclass(eq=False)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[_SequenceText | None]  # by index; None until the core starts that output
    # The EOS ids whose token, when the sequence stops on it, gives no text (none with ignore_eos
    # or include_stop_str_in_output); a stop token id's, the core names (output.stop_reason).
    hidden_eos_ids: frozenset[int] = frozenset()
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # once the core sent them
    prompt_logprobs_sent: bool = False  # in a DELTA output
    num_finished: int = 0

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}

    def add_request(self, request: EngineCoreRequest, prompt: str | None) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        params = request.sampling_params
        hidden_eos = params.include_stop_str_in_output or params.ignore_eos
        self._requests[request.request_id] = _RequestState(
            request.request_id, prompt, request.prompt_token_ids, params,
            RequestMetrics(request.arrival_time), [None] * params.n,
            frozenset(() if hidden_eos else request.eos_token_ids))

    def abort_request(self, request_id: str) -> bool:
        """Forget a request (no output for it); False if it was unknown or finished."""
        return self._requests.pop(request_id, None) is not None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Take one core step's outputs; return the RequestOutputs due now, and the sequences
        stop strings finished (for the core to abort)."""
        now = time.monotonic()
        result = ProcessedOutputs([])
        changed: dict[str, _RequestState] = {}
        for output in outputs:
            state = self._requests.get(output.request_id)
            if state is None:  # aborted, or finished by a stop string a step ago
                continue
            if output.pooled is not None:  # a pooling request: its one, final output
                result.request_outputs.append(self._pooling_output(state, output, now))
                continue
            seq = state.seqs[output.index] or self._start_sequence(state, output)
            if seq.finish_reason is not None:
                continue
            metrics = state.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                metrics.first_scheduled_time = output.first_scheduled_time
            if self._add_tokens(seq, output, state.hidden_eos_ids):  # a stop string ended it
                if output.finish_reason is None:
                    result.sequences_to_abort.append((state.request_id, seq.index))
            elif output.finish_reason is not None:
                seq.finish(output.finish_reason, output.stop_reason)
            if seq.finish_reason is not None:
                state.num_finished += 1
                metrics.num_preemptions += output.num_preemptions
            changed[state.request_id] = state
        for state in changed.values():
            request_output = self._request_output(state, now)
            if request_output is not None:
                result.request_outputs.append(request_output)
        return result

    def _pooling_output(self, state: _RequestState, output: EngineCoreOutput,
                        now: float) -> PoolingRequestOutput:
        del self._requests[state.request_id]
        metrics = state.metrics
        metrics.first_scheduled_time = output.first_scheduled_time
        metrics.first_token_time = metrics.finished_time = now  # the vector is its first output
        return PoolingRequestOutput(state.request_id, state.prompt, state.prompt_token_ids,
                                    PoolingOutput(output.pooled), metrics, output.num_cached_tokens)

    def _start_sequence(self, state: _RequestState, output: EngineCoreOutput) -> _SequenceText:
        params = state.params
        detokenizer = self.tokenizer.detokenizer(state.prompt_token_ids,
                                                 skip_special_tokens=params.skip_special_tokens)
        seq = _SequenceText(output.index, detokenizer, params.stop, params.include_stop_str_in_output,
                            holdback=max((len(s) for s in params.stop), default=1) - 1)
        state.seqs[output.index] = seq
        if output.index == 0:
            state.num_cached_tokens = output.num_cached_tokens
            if output.prompt_logprobs is not None:
                state.prompt_logprobs = [None if lp is None else self._logprob_entry(lp)
                                         for lp in output.prompt_logprobs]
        return seq

    def _add_tokens(self, seq: _SequenceText, output: EngineCoreOutput,
                    hidden_eos_ids: frozenset[int]) -> bool:
        """Append the new tokens (text and logprobs); True if a stop string ended the sequence.
        The token the core stopped the sequence on gives no text if it is an EOS of hidden_eos_ids
        or the stop token id the core names (not a token that completed the grammar)."""
        logprobs = output.new_logprobs
        tokens = output.new_token_ids
        last = tokens[-1] if output.finish_reason == "stop" and tokens else None
        stopped_on = last is not None and (last in hidden_eos_ids or (
            last == output.stop_reason and not seq.include_stop))
        unseen = len(tokens) - 1 if stopped_on else None
        for i, token_id in enumerate(tokens):
            seq.token_ids.append(token_id)
            if logprobs is not None:
                self._add_logprobs(seq, logprobs[i])
            if i == unseen:
                continue
            delta = seq.detokenizer.add(token_id)
            if delta and seq.add_text(delta):
                return True
        return False

    def _add_logprobs(self, seq: _SequenceText, lp: TokenLogprobs) -> None:
        if seq.logprobs is None:
            seq.logprobs = []
        seq.logprobs.append(self._logprob_entry(lp))
        seq.cumulative_logprob += lp.logprob

    def _logprob_entry(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        """The chosen (or given) token first, then the top-N by rank (vLLM's order, which its
        API's logprobs lists keep), by id, with their decoded text."""
        entry = {lp.token_id: Logprob(lp.logprob, lp.rank, self._decode_one(lp.token_id))}
        ranks = lp.top_ranks or range(1, len(lp.top) + 1)
        for rank, (tid, val) in zip(ranks, lp.top):
            entry.setdefault(tid, Logprob(val, rank, self._decode_one(tid)))
        return entry

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _request_output(self, state: _RequestState, now: float) -> RequestOutput | None:
        finished = state.finished
        if finished:
            del self._requests[state.request_id]
            state.metrics.finished_time = now
            state.metrics.num_output_tokens = max(len(s.token_ids) for s in state.seqs)
        kind = state.params.output_kind
        seqs = [s for s in state.seqs if s is not None]
        if kind is RequestOutputKind.DELTA:
            outputs = [s.output(delta=True) for s in seqs if s.has_news]
            if not outputs:
                return None
        elif finished or kind is RequestOutputKind.CUMULATIVE:
            outputs = [s.output(delta=False) for s in seqs]
        else:  # FINAL_ONLY, still running
            return None
        prompt_logprobs = state.prompt_logprobs
        if kind is RequestOutputKind.DELTA:  # only in the first output
            prompt_logprobs = None if state.prompt_logprobs_sent else prompt_logprobs
            state.prompt_logprobs_sent = state.prompt_logprobs is not None
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            outputs=outputs, finished=finished, metrics=state.metrics,
            num_cached_tokens=state.num_cached_tokens, prompt_logprobs=prompt_logprobs)
