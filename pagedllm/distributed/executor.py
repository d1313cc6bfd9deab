"""The tensor-parallel executor: rank 0's executor, which runs every step with its workers.

It is the local executor (pagedllm.worker.executor) over rank 0's shard, whose runner is built
mirrored (its packet carries what the workers' copies of the block table and KV cache need), plus
the two messages that keep the workers in step (pagedllm.distributed.protocol): before rank 0 runs
a step its packet goes to the workers, and before it computes logits of rows of the last step
(prompt logprobs) the rows' range goes too; every rank then makes the same collectives. The
workers build their runners from the arguments rank 0's was built with (start_workers).
"""

from __future__ import annotations

import torch

from pagedllm.distributed.driver import TensorParallelDriver
from pagedllm.worker.executor import LocalExecutor
from pagedllm.worker.pooler import Pooler
from pagedllm.worker.runner import ModelRunner, StepInputs, StepOutput


class TensorParallelExecutor(LocalExecutor):
    def __init__(self, runner: ModelRunner, driver: TensorParallelDriver, worker_args: dict,
                 pooler: Pooler | None = None) -> None:
        """worker_args: the runner's arguments the workers build theirs with (the KV cache rank 0
        planned); returns once every worker is ready. pooler: a pooling engine's."""
        if not runner.mirrored:
            raise ValueError("a tensor-parallel executor needs a runner built with mirrored=True")
        super().__init__(runner, pooler)
        self.driver = driver
        driver.start_workers(worker_args)

    def close(self) -> None:
        self.driver.close()

    def _run(self, step: StepInputs, argmax_only: bool) -> StepOutput:
        self.driver.send_step(step.layout, step.table_shape, step.packet)
        return super()._run(step, argmax_only)

    def _logits(self, hidden: torch.Tensor, start: int, end: int) -> torch.Tensor:
        self.driver.send_logits(start, end)
        return super()._logits(hidden, start, end)
