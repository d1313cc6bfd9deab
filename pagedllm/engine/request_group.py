"""One user request inside the engine core: its sequences, and how they multiply.

A request asking for n outputs starts as one sequence (index 0), which prefills the prompt. When
the prompt's logits come, its first sample draws n tokens from them (fan_out: n sampling rows from
one row of logits), each output with its own seeded generator: sequence 0 keeps the first and
n - 1 children fork off it (branch), sharing its blocks by reference count (the first write into a
shared partial block copies it). Beam search forks the same way, choosing the tokens itself. What a
step gives each sequence is a Choice: its tokens, the first continuing it and each further one
forking a child, none ending it. The group ends when every sequence it has ended.

A constrained sequence (structured outputs) carries its grammar's matcher: a child's is a fork of
its parent's state before the parent's token, and advance_grammar says how a kept token ends the
sequence, if it does: its grammar complete ("stop", even before an EOS that is the only token left),
or the token refused ("abort": only a chooser, or logits all -inf, can pick one).

The prompt logprobs a request asks for are filled in here as its prompt's chunks run (by position,
so a recompute after preemption rewrites the same entries) and handed out once, with the first
output.

Everything a sequence's sampling needs that does not change from step to step (its sampling
row, the stop ids banned before min_tokens, the token rules' tensors) is made here once, not
rebuilt every step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from pagedllm.core.request import Request, RequestStatus
from pagedllm.engine.messages import EngineCoreOutput, EngineCoreRequest
from pagedllm.outputs import TokenLogprobs
from pagedllm.structured.matcher import GrammarMatcher
from pagedllm.worker.sampler import SamplingRow, TokenRules, takes_argmax

logger = logging.getLogger(__name__)


# What one step gives a sequence that sampled: its tokens (the first continues it, each further
# one forks a child off it, none ends it) and their log-probabilities. A plain pair, not a class:
# one is made per sequence per step, and a NamedTuple's constructor is a Python call each time.
Choice = tuple[list[int], list[TokenLogprobs | None]]


@dataclass(eq=False)
class CoreSequence:
    group: RequestGroup
    index: int  # among its request's outputs
    request: Request  # what the scheduler and the KV manager see
    row: SamplingRow  # reads request's tokens as they grow
    # Its grammar's state after its output tokens (structured outputs; None: unconstrained).
    matcher: GrammarMatcher | None = None

    @property
    def takes_argmax(self) -> bool:
        """Whether its next token is its logits' argmax alone (no grammar, no fan-out)."""
        return self.matcher is None and self.group.fan_out == 1 and takes_argmax(self.row)

    def advance_grammar(self, token: int) -> RequestStatus | None:
        """Advance the matcher by the token the sequence kept; the status to finish it with,
        if that ends it (its grammar complete: stopped; the token refused: aborted)."""
        matcher = self.matcher
        if matcher is None or self.request.is_finished:
            return None
        if matcher.accept_token(token):
            return RequestStatus.FINISHED_STOPPED if matcher.is_terminated else None
        logger.error("request %s: the grammar refused token %d (%s); ending the sequence",
                     self.request.request_id, token, matcher.error)
        return RequestStatus.FINISHED_ABORTED

    def output(self, tokens: list[int], logprobs: list[TokenLogprobs | None]) -> EngineCoreOutput:
        """Its output for new tokens (one, or a speculative step's run), with its prompt's
        prefix-cache hit and first run (as its group's first sequence had them)."""
        first = self.group.seqs[0].request
        return EngineCoreOutput(self.group.request_id, self.index, tokens,
                                None if logprobs[0] is None else logprobs,
                                num_cached_tokens=first.num_cached_tokens,
                                first_scheduled_time=first.first_scheduled_time)


@dataclass(eq=False)
class RequestGroup:
    request_id: str
    request: EngineCoreRequest
    # Banned while fewer than min_tokens are out: the stop token ids and every EOS id.
    early_stop_ids: tuple[int, ...]
    # One seeded generator per output index, so output i is reproducible on its own.
    generators: list[torch.Generator | None]
    rules: TokenRules | None  # allowed_token_ids, bad_words, logit_bias: shared by every sequence
    seqs: list[CoreSequence] = field(default_factory=list)
    fan_out: int = 1  # tokens the next sample of sequence 0 draws: n until the prompt's first
    num_finished: int = 0
    # SamplingParams.prompt_logprobs: one entry per prompt token, filled as the prompt's chunks
    # run (by position, so a recompute after preemption rewrites the same entries).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False

    @classmethod
    def start(cls, request: EngineCoreRequest, device: torch.device) -> RequestGroup:
        """The group with its first sequence, the one that prefills the prompt."""
        params = request.sampling_params
        generators: list[torch.Generator | None] = [None] * params.n
        if params.seed is not None:
            generators = [torch.Generator(device=device).manual_seed((params.seed + i) % 2**63)
                          for i in range(params.n)]
        # vLLM's and transformers' rule: before min_tokens, no way to stop, ignore_eos or not.
        early_stop_ids = tuple(dict.fromkeys([*params.stop_token_ids, *request.eos_token_ids]))
        rules = TokenRules.build(params, request.bad_words_token_ids, device)
        group = cls(request.request_id, request, early_stop_ids, generators, rules, fan_out=params.n)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(request.prompt_token_ids)
        first = Request(request.request_id, request.prompt_token_ids, params,
                        eos_token_ids=request.eos_token_ids, arrival_time=request.arrival_time,
                        cache_salt=request.cache_salt, lora_key=request.lora and request.lora.key,
                        priority=request.priority)
        group._add(first)
        return group

    @property
    def finished(self) -> bool:
        return self.fan_out == 1 and self.num_finished == len(self.seqs)

    @property
    def collecting_prompt_logprobs(self) -> bool:
        """Whether it asks for prompt logprobs and has not had them handed out yet."""
        return self.prompt_logprobs is not None and not self.prompt_logprobs_sent

    def record_prompt_logprobs(self, first: int, values: list[TokenLogprobs]) -> None:
        """Prompt tokens first .. first + len(values) - 1's logprobs, as a chunk gave them."""
        self.prompt_logprobs[first:first + len(values)] = values

    def take_prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        """The prompt logprobs, once (with the first output); None after, or if not asked for."""
        if not self.collecting_prompt_logprobs:
            return None
        self.prompt_logprobs_sent = True
        return self.prompt_logprobs

    def take_fan_out_rows(self, seq: CoreSequence) -> list[SamplingRow]:
        """The n rows the prompt's first sample draws from sequence 0's logits, one for each
        output (with its own generator); later samples draw one row each."""
        rows = [seq.row] + [replace(seq.row, generator=g) for g in self.generators[1:self.fan_out]]
        self.fan_out = 1
        return rows

    def branch(self, parent: CoreSequence, tokens: list[int]) -> list[CoreSequence]:
        """The children of a sequence given tokens (call before parent's matcher takes tokens[0]):
        one per token after the first, each continuing parent's tokens but the last, then its
        token; its grammar's state forked off parent's, from which every token was drawn."""
        return [self._fork(parent, token) for token in tokens[1:]]

    def _fork(self, parent: CoreSequence, token: int) -> CoreSequence:
        index = len(self.seqs)
        child = self._add(parent.request.fork(f"{self.request_id}#{index}", token))
        child.matcher = parent.matcher and parent.matcher.fork()
        return child

    def _add(self, request: Request) -> CoreSequence:
        index = len(self.seqs)
        generator = self.generators[index] if index < len(self.generators) else None
        row = SamplingRow(request.sampling_params, request, self.early_stop_ids, generator, self.rules)
        seq = CoreSequence(self, index, request, row)
        self.seqs.append(seq)
        return seq


def fan_out(seqs: Sequence[CoreSequence]) -> tuple[list[SamplingRow], list[int]]:
    """The sampler's rows for sequences with logits: one each, but n for a prompt's first sample
    (its fan-out, from the same logits); and for each row, the sequence it samples for."""
    rows: list[SamplingRow] = []
    row_of: list[int] = []
    for j, seq in enumerate(seqs):
        group_rows = seq.group.take_fan_out_rows(seq) if seq.group.fan_out > 1 else (seq.row,)
        rows.extend(group_rows)
        row_of.extend([j] * len(group_rows))
    return rows, row_of


def gather(num_seqs: int, row_of: list[int], token_ids: list[int],
           logprobs: list[TokenLogprobs | None]) -> list[Choice]:
    """Each sequence's Choice from the sampled rows (row_of: fan_out's)."""
    choices: list[Choice] = [([], []) for _ in range(num_seqs)]
    for j, token, lp in zip(row_of, token_ids, logprobs):
        choices[j][0].append(token)
        choices[j][1].append(lp)
    return choices
