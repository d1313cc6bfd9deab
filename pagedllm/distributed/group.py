"""One tensor-parallel group's collectives: gloo (torch.distributed) between the ranks' processes.

The group is a ProcessGroupGloo made over a store, held by the engine and not registered as
torch.distributed's default group: no global state, so one process can hold several engines.

Timeouts: every collective of a step waits at most `timeout_s` for the other ranks (a rank that
hangs), and fails at once when a peer's connection closes (a rank that died). Only a worker
waiting for rank 0's next step waits without a bound in practice (an idle engine sends nothing).
Any failure leaves the group broken: every later call raises TensorParallelError at once, with
the first failure's reason, since the ranks can no longer be in step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

# Connecting the ranks (and a worker's wait for the next step) may take this long.
CONNECT_TIMEOUT = timedelta(minutes=30)
IDLE_TIMEOUT = timedelta(days=365)


class TensorParallelError(RuntimeError):
    """The tensor-parallel group failed: a rank died, hung past the timeout or lost its connection.
    The engine cannot run another step."""


class TensorParallelGroup:
    def __init__(self, store: dist.Store, rank: int, size: int, timeout_s: float) -> None:
        self.rank, self.size = rank, size
        self._group = dist.ProcessGroupGloo(store, rank, size, CONNECT_TIMEOUT)
        self._group.set_timeout(timedelta(seconds=timeout_s))
        self.broken: str | None = None
        # Says what is known of the other ranks when a collective fails (rank 0: its workers).
        self.describe_peers: Callable[[], str] = lambda: ""
        # Time spent in all-reduces and how many, for the measurements of docs/distributed.md.
        self.all_reduce_s = 0.0
        self.num_all_reduces = 0

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum tensor over the ranks, in place."""
        started = time.perf_counter()
        self._wait("all_reduce", lambda: self._group.allreduce([tensor]))
        self.all_reduce_s += time.perf_counter() - started
        self.num_all_reduces += 1

    def broadcast(self, tensor: torch.Tensor, idle: bool = False) -> None:
        """Rank 0's tensor into every rank's. idle: a worker waiting for the next step, for as
        long as the engine has nothing to run."""
        self._wait("broadcast", lambda: self._group.broadcast(tensor, 0, IDLE_TIMEOUT if idle else None))

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's tensor (all of one shape) on rank 0, in rank order; None elsewhere."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == 0 else []
        self._wait("gather", lambda: self._group.gather(parts, tensor, 0))
        return parts or None

    def _wait(self, what: str, start: Callable[[], dist.Work]) -> None:
        if self.broken is not None:
            raise TensorParallelError(self.broken)
        try:
            start().wait()
        except RuntimeError as exc:
            peers = self.describe_peers()
            self.broken = (f"tensor parallel {what} failed on rank {self.rank} of {self.size}"
                           f"{f' ({peers})' if peers else ''}: {_first_line(exc)}")
            raise TensorParallelError(self.broken) from exc


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
