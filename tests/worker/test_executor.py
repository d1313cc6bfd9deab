"""The local executor over a runner with a recording model: one SchedulerOutput in, the sampling
rows' logits and the prompt logprobs out, each prompt position rating the next prompt token from
its own row of the flat batch even where the batch runs in another order than the scheduled one."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from pagedllm.core.scheduler import ScheduledRequest, SchedulerOutput
from pagedllm.worker import executor as executor_module
from pagedllm.worker.executor import LocalExecutor
from pagedllm.worker.runner import ModelRunner
from tests.worker.test_runner import BLOCK_SIZE, RecordingModel

VOCAB = 100


class NextTokenModel(RecordingModel):
    """A token's logits: 0 everywhere but 10 at its input id + 1, so a prompt of consecutive ids
    rates each next prompt token high only when read from that token's own row."""

    def compute_logits(self, hidden):
        logits = torch.zeros(hidden.shape[0], VOCAB)
        logits[torch.arange(hidden.shape[0]), (hidden[:, 0].long() + 1) % VOCAB] = 10.0
        return logits


HIGH = 10.0 - math.log(math.exp(10.0) + VOCAB - 1)  # the next token's log-probability


def make_executor() -> LocalExecutor:
    runner = ModelRunner(NextTokenModel(), num_blocks=32, block_size=BLOCK_SIZE, max_num_batched_tokens=64,
                         max_model_len=64, kv_dtype=torch.float32)
    return LocalExecutor(runner)


def step(*scheduled: ScheduledRequest, finished=()) -> SchedulerOutput:
    return SchedulerOutput(list(scheduled), [], [], list(finished),
                           sum(s.num_new_tokens for s in scheduled))


def request(request_id: str, prompt: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, token_ids=list(prompt), num_tokens=len(prompt),
                           prompt_token_ids=list(prompt), num_prompt_tokens=len(prompt))


def test_prompt_logprobs_read_each_chunk_from_its_own_rows_when_the_batch_is_reordered(monkeypatch):
    monkeypatch.setattr(executor_module, "PROMPT_LOGPROB_ROWS", 3)  # slices of 3 rows, a short last
    ex = make_executor()
    a, b, c = request("a", [1, 2, 3]), request("b", list(range(20, 40))), request("c", [50, 51])
    first = ex.execute(step(ScheduledRequest(a, 3, 0, [0], BLOCK_SIZE),
                            ScheduledRequest(b, 8, 0, [1, 2], BLOCK_SIZE),
                            ScheduledRequest(c, 2, 0, [3], BLOCK_SIZE)), prompt_logprobs={"b": 1})
    assert first.sample_indices == [0, 2]
    (found,) = first.prompt_logprobs.values()
    assert found.first == 1 and [lp.logprob for lp in found.values] == pytest.approx([HIGH] * 8, abs=1e-5)
    # a finished: c takes its row 0, so the batch runs c (1 token), then b (7): not the scheduled order.
    c.token_ids.append(52)
    c.num_tokens = 3
    second = ex.execute(step(ScheduledRequest(b, 7, 8, [1, 2, 3 + 1], BLOCK_SIZE),
                             ScheduledRequest(c, 1, 2, [3], BLOCK_SIZE), finished=[a]),
                        prompt_logprobs={"b": 2})
    assert ex.runner.block_table.row_of("c") == 0 and second.sample_indices == [1]
    found = second.prompt_logprobs["b"]
    assert found.first == 9 and len(found.values) == 7
    assert [lp.logprob for lp in found.values] == pytest.approx([HIGH] * 7, abs=1e-5)
    assert all(lp.token_id == b.prompt_token_ids[9 + i] for i, lp in enumerate(found.values))


def test_a_step_with_nothing_scheduled_still_drops_the_finished_rows():
    ex = make_executor()
    a = request("a", [1, 2, 3])
    ex.execute(step(ScheduledRequest(a, 3, 0, [0], BLOCK_SIZE)))
    assert ex.runner.block_table.row_of("a") == 0
    nothing = ex.execute(step(finished=[a]))
    assert nothing.sample_indices == [] and nothing.prompt_logprobs == {}
    assert ex.runner.block_table.sync("next", [5]) == 0  # a's row is free again
