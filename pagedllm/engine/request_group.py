"""One user request inside the engine core: its sequences, and how they multiply.

A request asking for n outputs starts as one sequence (index 0), which prefills the prompt. When
the prompt's logits come, its first sample draws n tokens from them, each output with its own
seeded generator: sequence 0 keeps the first and n - 1 children fork off it, sharing its blocks
by reference count (the first write into a shared partial block copies it). Beam search forks
the same way, choosing the tokens itself. The group ends when every sequence it has ended.

Everything a sequence's sampling needs that does not change from step to step (its sampling
row, the stop ids banned before min_tokens, the token rules' tensors) is made here once, not
rebuilt every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from pagedllm.core.request import Request
from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.outputs import TokenLogprobs
from pagedllm.structured.matcher import GrammarMatcher
from pagedllm.worker.sampler import SamplingRow, TokenRules


@dataclass(eq=False)
class CoreSequence:
    group: RequestGroup
    index: int  # among its request's outputs
    request: Request  # what the scheduler and the KV manager see
    row: SamplingRow  # reads request's tokens as they grow
    # Its grammar's state after its output tokens (structured outputs; None: unconstrained).
    matcher: GrammarMatcher | None = None


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
                        cache_salt=request.cache_salt)
        group._add(first)
        return group

    @property
    def finished(self) -> bool:
        return self.fan_out == 1 and self.num_finished == len(self.seqs)

    def take_fan_out_rows(self, seq: CoreSequence) -> list[SamplingRow]:
        """The n rows the prompt's first sample draws from sequence 0's logits, one for each
        output (with its own generator); later samples draw one row each."""
        rows = [seq.row] + [replace(seq.row, generator=g) for g in self.generators[1:self.fan_out]]
        self.fan_out = 1
        return rows

    def fork(self, parent: CoreSequence, token: int) -> CoreSequence:
        """A new sequence continuing parent's tokens but the last, then token (the next index)."""
        index = len(self.seqs)
        return self._add(parent.request.fork(f"{self.request_id}#{index}", token))

    def _add(self, request: Request) -> CoreSequence:
        index = len(self.seqs)
        generator = self.generators[index] if index < len(self.generators) else None
        row = SamplingRow(request.sampling_params, request, self.early_stop_ids, generator, self.rules)
        seq = CoreSequence(self, index, request, row)
        self.seqs.append(seq)
        return seq
