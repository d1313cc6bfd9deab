"""The executor: what stands between the engine core and the model runner (vLLM's Executor and
Worker split).

The core hands it each step's SchedulerOutput, and nothing else of the model's side is the core's
to know. The executor drops the table rows of requests that finished or were preempted, makes the
step's block copies, has the runner build and run this rank's batch, and gives back the logits of
the rows that sample (or their argmax tokens) together with the prompt logprobs the step's prompt
chunks yield for the requests that ask: each prompt position's logits rate the next prompt token,
a slice of PROMPT_LOGPROB_ROWS positions at a time so that the [rows, vocab] tensor stays bounded.
In a pooling engine it hands each request's chunk of final hidden states to the pooler
(pagedllm.worker.pooler), which gives back the request's vector at its last chunk.

LocalExecutor runs this process's one runner. The tensor-parallel executor
(pagedllm.distributed.executor) is the same with two more messages: each step's packet and each
logits call's rows go to the workers first, so that every rank takes part in the same collectives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.model.decode_layers import BurstSpeculation
from pagedllm.outputs import TokenLogprobs
from pagedllm.pooling_params import PoolingParams
from pagedllm.spec_decode.ngram import NgramBurst
from pagedllm.worker.pooler import Pooler
from pagedllm.worker.runner import BurstOutput, ModelRunner, StepInputs, StepOutput
from pagedllm.worker.sampler import Sampler

# Prompt positions turned into logits at once for prompt logprobs: bounds the [rows, vocab] tensor.
PROMPT_LOGPROB_ROWS = 256


class PromptLogprobs(NamedTuple):
    """The log-probabilities of prompt tokens first .. first + len(values) - 1 (the first prompt
    token has none: nothing comes before it)."""

    first: int
    values: list[TokenLogprobs]


class ExecutorOutput(NamedTuple):
    # [R, vocab] float32 logits of the rows that sample (a speculating request's 1 + k in a row,
    # ScheduledRequest.num_spec_tokens); with argmax_only, [R] int64 tokens.
    logits: torch.Tensor
    sample_indices: list[int]  # [S]: each sampling request's index in the scheduled list
    prompt_logprobs: dict[str, PromptLogprobs]  # by the scheduler's request id
    # A pooling engine's: the vectors of the requests whose last chunk ran (PoolingParams).
    pooled: dict[str, list[float]] = {}


_NOTHING = ExecutorOutput(torch.empty(0), [], {})


class LocalExecutor:
    def __init__(self, runner: ModelRunner, pooler: Pooler | None = None) -> None:
        """pooler: a pooling engine's (pagedllm.worker.pooler)."""
        self.runner = runner
        self.pooler = pooler

    def execute(self, out: SchedulerOutput, argmax_only: bool = False,
                prompt_logprobs: Mapping[str, int] | None = None,
                pooling: Mapping[str, PoolingParams] | None = None) -> ExecutorOutput:
        """Run one scheduled step. argmax_only: every sampling row takes its argmax alone, so
        only those tokens come back. prompt_logprobs: the number of top tokens each request
        (scheduler's id) that wants its prompt's logprobs asks for. pooling: the scheduled
        pooling requests' params (a pooling engine's)."""
        dropped = out.finished + out.preempted
        self.runner.drop_requests(dropped, out.trimmed)
        if self.pooler is not None:
            self.pooler.forget(r.request_id for r in dropped)
        if not out.scheduled:
            return _NOTHING
        self.runner.copy_blocks(out.block_copies)
        step = self.runner.prepare_inputs(out.scheduled, out.block_copies)
        result = self._run(step, argmax_only)
        found = self._prompt_logprobs(out, step, result.hidden, prompt_logprobs) if prompt_logprobs else {}
        pooled = self._pool(out, step, result.hidden, pooling) if pooling else {}
        return ExecutorOutput(result.logits, result.sample_indices, found, pooled)

    @property
    def runs_bursts(self) -> bool:
        """Whether execute_burst may run (a generating engine's runner that runs bursts)."""
        return self.pooler is None and self.runner.runs_bursts

    @property
    def speculates_in_bursts(self) -> bool:
        """Whether execute_burst may take n-gram speculation (ModelRunner.speculates_in_bursts)."""
        return self.runs_bursts and self.runner.speculates_in_bursts

    def execute_burst(self, out: SchedulerOutput, ngram: NgramBurst | None = None,
                      max_steps: int = 0) -> tuple[BurstOutput, list[int]]:
        """Run a scheduled decode burst (pagedllm.engine.decode_burst), with n-gram speculation in
        its steps where `ngram` is given: each sampling sequence's tokens and steps (ModelRunner.
        run_burst), and the sequences' indices in the scheduled list, by row."""
        self.runner.drop_requests(out.finished + out.preempted, out.trimmed)
        if not out.scheduled:
            return BurstOutput([], []), []
        self.runner.copy_blocks(out.block_copies)
        step = self.runner.prepare_inputs(out.scheduled, out.block_copies)
        speculation = None
        if ngram is not None:
            ids = [out.scheduled[i].request.request_id for i in step.sample_indices]
            speculation = BurstSpeculation([torch.from_numpy(ngram.histories[i]) for i in ids],
                                           [ngram.ks[i] for i in ids], ngram.lookup_min, ngram.lookup_max)
        return self.runner.run_burst(step, speculation, max_steps), step.sample_indices

    def close(self) -> None:
        """Nothing to stop in this process (the tensor-parallel executor stops its workers)."""

    def _run(self, step: StepInputs, argmax_only: bool) -> StepOutput:
        return self.runner.run(step, argmax_only)

    def _logits(self, hidden: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return self.runner.compute_logits(hidden, start, end)

    def _pool(self, out: SchedulerOutput, step: StepInputs, hidden: torch.Tensor,
              pooling: Mapping[str, PoolingParams]) -> dict[str, list[float]]:
        """Each pooling request's chunk to the pooler; the vectors of those it finished."""
        if self.pooler is None:
            raise ValueError("pooling requests need an engine started with --runner pooling")
        pooled: dict[str, list[float]] = {}
        starts = step.token_starts()  # the batch runs in block-table row order
        for index, s in enumerate(out.scheduled):
            params = pooling.get(s.request.request_id)
            if params is None:
                continue
            row = starts[index]
            vector = self.pooler.take_chunk(
                s.request.request_id, hidden[row:row + s.num_new_tokens], s.num_computed_tokens,
                s.request.num_tokens, params,
                lambda i, row=row, params=params: self._label_logits(hidden, row + i, params))
            if vector is not None:
                pooled[s.request.request_id] = vector
        return pooled

    def _label_logits(self, hidden: torch.Tensor, row: int, params: PoolingParams) -> torch.Tensor:
        """A score or reward request's label logits at one row: its label tokens' logits, or with
        none, the sequence classifier's head."""
        if params.label_token_ids:
            return self._logits(hidden, row, row + 1)[0, list(params.label_token_ids)]
        return self.runner.model.classify(hidden[row:row + 1])[0]

    def _prompt_logprobs(self, out: SchedulerOutput, step: StepInputs, hidden: torch.Tensor,
                         wanted: Mapping[str, int]) -> dict[str, PromptLogprobs]:
        """What this step's prompt chunks give: position p's logits rate prompt token p + 1."""
        found: dict[str, PromptLogprobs] = {}
        starts = None
        for index, s in enumerate(out.scheduled):
            num_top = wanted.get(s.request.request_id)
            first = s.num_computed_tokens
            count = min(s.num_new_tokens, s.request.num_prompt_tokens - 1 - first)
            if num_top is None or count <= 0:
                continue
            starts = starts or step.token_starts()  # the batch runs in block-table row order
            row = starts[index]
            values: list[TokenLogprobs] = []
            for a in range(0, count, PROMPT_LOGPROB_ROWS):
                n = min(PROMPT_LOGPROB_ROWS, count - a)
                targets = s.request.prompt_token_ids[first + a + 1:first + a + n + 1]
                values += Sampler.logprobs_of(self._logits(hidden, row + a, row + a + n), targets, num_top)
            found[s.request.request_id] = PromptLogprobs(first + 1, values)
        return found
