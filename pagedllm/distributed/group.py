"""One tensor-parallel group's collectives (torch.distributed) between the ranks' processes.

Backends: gloo always, for what crosses on the host (each step's header and packet of integers)
and for the activations of ranks on the CPU; on CUDA (one process per GPU, rank r on the GPU after
rank 0's by r) an NCCL group besides it takes the collectives of device tensors, the all-reduces
of activations and the gather of logits (an all-gather: NCCL's gather is sends and receives). The
groups are made over a store, held by the engine and not registered as torch.distributed's default
group: no global state, so one process can hold several engines.

Timeouts: every collective of a step waits at most `timeout_s` for the other ranks (a rank that
hangs), and fails at once when a peer's connection closes (a rank that died). Only a worker
waiting for rank 0's next step waits without a bound in practice (an idle engine sends nothing).
Any failure leaves the group broken: every later call raises TensorParallelError at once, with
the first failure's reason, since the ranks can no longer be in step. NCCL's collectives are
asynchronous to the host: waiting on one orders the GPU's stream, not the process, so a rank that
hangs or dies is found by NCCL's own watchdog after `timeout_s`, which ends the process (the engine
then fails as when a worker dies), not by a TensorParallelError; the all-reduce times counted below
are then the launches' only.
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


def backend_for(device: torch.device) -> str:
    """The backend of the collectives over tensors on `device`: gloo on the CPU, NCCL on CUDA;
    ValueError naming what is allowed for anything else, or CUDA with a torch built without NCCL."""
    if device.type == "cpu":
        return "gloo"
    if device.type == "cuda":
        if not dist.is_nccl_available():
            raise ValueError(f"tensor parallelism on {device} needs NCCL, which this torch build "
                             f"({torch.__version__}) lacks; use --device cpu")
        return "nccl"
    raise ValueError(f"tensor parallelism runs on the CPU (gloo) or CUDA GPUs (NCCL); got device {device}")


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of the rank that is local_rank-th on its machine, rank 0 running on `device`: the
    CPU for every rank, or on CUDA one GPU each, counting on from rank 0's."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + local_rank)


class TensorParallelGroup:
    def __init__(self, store: dist.Store, rank: int, size: int, timeout_s: float,
                 device: torch.device = torch.device("cpu")) -> None:
        self.rank, self.size = rank, size
        self.device = device
        self.backend = backend_for(device)
        self._group = dist.ProcessGroupGloo(store, rank, size, CONNECT_TIMEOUT)
        self._group.set_timeout(timedelta(seconds=timeout_s))
        self._device_group = None  # NCCL, for the collectives of CUDA tensors
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timedelta(seconds=timeout_s)
            self._device_group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, options)
        self.broken: str | None = None
        # Says what is known of the other ranks when a collective fails (rank 0: its workers).
        self.describe_peers: Callable[[], str] = lambda: ""
        # Time spent in all-reduces and how many, for the measurements of docs/distributed.md.
        self.all_reduce_s = 0.0
        self.num_all_reduces = 0

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum tensor over the ranks, in place."""
        started = time.perf_counter()
        self._wait("all_reduce", lambda: self._group_of(tensor).allreduce([tensor]))
        self.all_reduce_s += time.perf_counter() - started
        self.num_all_reduces += 1

    def broadcast(self, tensor: torch.Tensor, idle: bool = False) -> None:
        """Rank 0's tensor into every rank's. idle: a worker waiting for the next step, for as
        long as the engine has nothing to run."""
        self._wait("broadcast", lambda: self._group.broadcast(tensor, 0, IDLE_TIMEOUT if idle else None))

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's tensor (all of one shape) on rank 0, in rank order; None elsewhere."""
        group = self._group_of(tensor)
        if group is self._device_group:  # an all-gather: every rank receives, rank 0 keeps them
            parts = [torch.empty_like(tensor) for _ in range(self.size)]
            self._wait("gather", lambda: group.allgather([parts], [tensor]))
            return parts if self.rank == 0 else None
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == 0 else []
        self._wait("gather", lambda: group.gather(parts, tensor, 0))
        return parts or None

    def _group_of(self, tensor: torch.Tensor):
        """NCCL for tensors off the CPU where the group has it; gloo for host tensors."""
        return self._device_group if self._device_group is not None and tensor.device.type != "cpu" \
            else self._group

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
