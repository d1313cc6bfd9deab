"""Rank 0's side of tensor parallelism: start (or meet) the workers, load rank 0's shard, and send
each step to the workers.

Rank 0 is the engine core as without tensor parallelism (scheduler, KV manager, sampler, output);
ranks 1..N-1 are workers (pagedllm.distributed.worker) that run the same forward on their shards.
`load_engine_model` is the one call the engine makes: with tensor_parallel_size 1 it is
load_model; above it, it also starts the workers and gives back their driver, which the
tensor-parallel executor (pagedllm.distributed.executor) sends each step through:

- distributed_executor_backend "mp": this process spawns them (`python -m
  pagedllm.distributed.worker`, a process each, meeting at a store this process serves on
  127.0.0.1). They die with it: each gets SIGKILL from the kernel when this process ends
  (PR_SET_PDEATHSIG) and watches its stdin, a pipe only this process holds, for end of file.
- "external_launcher": they were started elsewhere, by torchrun or by hand, and all meet at
  MASTER_ADDR:MASTER_PORT (torch.distributed's env:// rendezvous: RANK, WORLD_SIZE).

Start-up waits for every worker to say it is ready, and fails with the reason of the first that
cannot (its error, or the exit code of a spawned worker that died); sizes that do not split fail
before anything starts (sharding.ShardPlan). The driver stops the workers when the engine goes
(the object is collected, or the interpreter exits).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import subprocess
import sys
import time
import weakref

import torch
import torch.distributed as dist

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.distributed import protocol
from pagedllm.distributed.group import (
    CONNECT_TIMEOUT,
    TensorParallelError,
    TensorParallelGroup,
    backend_for,
    rank_device,
)
from pagedllm.distributed.shard import RankShard
from pagedllm.distributed.sharding import ShardPlan
from pagedllm.kernels import tiers
from pagedllm.model.loader import LoadedModel, load_model, read_model_config, resolve_model_dtype
from pagedllm.worker.packet import PacketLayout

logger = logging.getLogger(__name__)

_POLL_S = 0.02
_STOP_WAIT_S = 5.0  # how long stopped workers get to exit before they are killed


class TensorParallelStartupError(RuntimeError):
    """A worker could not start (and was not refused for bad input, which is a ValueError)."""


def load_engine_model(config: EngineConfig,
                      device: torch.device) -> tuple[LoadedModel, TensorParallelDriver | None]:
    """The engine's model: whole (and no driver), or with tensor_parallel_size > 1 rank 0's shard
    and the driver of its workers, started, and ready once they are given the runner's arguments
    (TensorParallelDriver.start_workers)."""
    tiers.select(config.cpu_isa, device.type)  # the CPU kernels every layer takes, chosen once
    args = (config.model, config.dtype, device, config.quantization, config.quantization_group_size)
    size = config.tensor_parallel_size
    if size == 1:
        return load_model(*args), None
    backend = backend_for(device)  # ValueError for a device the collectives do not run on
    if device.type == "cuda" and config.distributed_executor_backend == "mp":
        last = rank_device(device, size - 1)
        if last.index >= torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={size} from {device} takes GPUs {device.index or 0} "
                             f"to {last.index} (one per rank); this machine has "
                             f"{torch.cuda.device_count()}")
    plan = ShardPlan(read_model_config(config.model), size)  # ValueError where sizes do not split
    driver = TensorParallelDriver.start(config, device)
    try:
        loaded = load_model(*args, shard=RankShard(plan, 0, driver.group))
    except BaseException:
        driver.close()
        raise
    loaded.weights_note += (f"; tensor parallel over {size} ranks ({driver.launch}, {backend}): "
                            f"{plan.describe()}, {torch.get_num_threads()} torch threads each")
    return loaded, driver


class TensorParallelDriver:
    def __init__(self, store: dist.Store, group: TensorParallelGroup,
                 processes: list[subprocess.Popen], launch: str) -> None:
        self.store = store
        self.group = group
        self.launch = launch  # how the workers started, for the start-up line
        self._processes = processes
        self.num_steps = 0  # steps sent, and the bytes broadcast for them (headers included)
        self.bytes_sent = 0
        self._workers_started = [False]  # a list: shared with the finalizer, which cannot hold self
        self._close = weakref.finalize(self, _stop_workers, store, group, processes,
                                       self._workers_started)

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> TensorParallelDriver:
        """Start (or meet) the workers and connect the group; they load their shards meanwhile."""
        size = config.tensor_parallel_size
        spawn = config.distributed_executor_backend == "mp"
        store = _serve_store(size) if spawn else _meet_store(size)
        threads = protocol.threads_per_rank(size) if spawn else protocol.launched_threads()
        torch.set_num_threads(threads)
        # The workers load what rank 0 resolved: the same dtype whatever their CPU says, and
        # rank 0's device, from which each takes its own (group.rank_device).
        resolved = resolve_model_dtype(config.dtype, device, config.model, config.quantization)
        dtype = str(resolved).removeprefix("torch.")
        settings = dataclasses.asdict(dataclasses.replace(config, dtype=dtype, device=str(device)))
        store.set(protocol.CONFIG_KEY, json.dumps(settings))
        store.set(protocol.THREADS_KEY, str(threads))
        processes = [_spawn_worker(rank, size, store) for rank in range(1, size)] if spawn else []
        try:
            _wait_for_workers(store, size, processes, protocol.hello_key, "connecting")
            if device.type == "cuda":
                torch.cuda.set_device(device)  # NCCL's communicator binds the current device
            group = TensorParallelGroup(store, 0, size, config.distributed_timeout_s, device)
        except BaseException:
            _stop_workers(store, None, processes, [False])
            raise
        group.describe_peers = functools.partial(_describe_workers, processes)
        launch = "spawned here" if spawn else "external launcher"
        return cls(store, group, processes, launch)

    def start_workers(self, runner_args: dict) -> None:
        """Give the workers the runner's arguments (the KV cache rank 0 planned) and wait until
        every one is ready to run steps."""
        self.store.set(protocol.RUNNER_KEY, json.dumps(runner_args))
        _wait_for_workers(self.store, self.group.size, self._processes, protocol.ready_key,
                          "loading the model")
        self._workers_started[0] = True

    def send_step(self, layout: PacketLayout, table_shape: tuple[int, int], packet: torch.Tensor) -> None:
        self.group.broadcast(protocol.step_header(layout, table_shape))
        self.group.broadcast(packet)
        self.num_steps += 1
        self.bytes_sent += 8 * (protocol.HEADER_LEN + packet.numel())

    def send_logits(self, start: int, end: int) -> None:
        self.group.broadcast(protocol.logits_header(start, end))
        self.bytes_sent += 8 * protocol.HEADER_LEN

    def close(self) -> None:
        """Stop the workers (also done when the driver is collected or the interpreter exits)."""
        self._close()


def _serve_store(size: int) -> dist.Store:
    """A store on a free port of 127.0.0.1, for workers spawned here."""
    store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=CONNECT_TIMEOUT, wait_for_workers=False)
    return dist.PrefixStore("pagedllm", store)


def _meet_store(size: int) -> dist.Store:
    """The store of an external launch (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
               if not envs.is_set(name)]
    if missing:
        raise ValueError(f"distributed_executor_backend='external_launcher' needs {', '.join(missing)} "
                         "in the environment (torchrun sets them; see docs/distributed.md)")
    if envs.RANK != 0 or envs.WORLD_SIZE != size:
        raise ValueError(f"the engine is rank 0 of tensor_parallel_size={size} ranks; the environment "
                         f"says RANK={envs.RANK}, WORLD_SIZE={envs.WORLD_SIZE}")
    store, _, _ = next(dist.rendezvous("env://", timeout=CONNECT_TIMEOUT))
    return dist.PrefixStore("pagedllm", store)


def _spawn_worker(rank: int, size: int, store: dist.PrefixStore) -> subprocess.Popen:
    """`python -m pagedllm.distributed.worker`, meeting at the store; it imports this pagedllm."""
    env = envs.child_environ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.underlying_store.port),
                              "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
                              "LOCAL_WORLD_SIZE": str(size)})
    return subprocess.Popen([sys.executable, "-m", "pagedllm.distributed.worker",
                             "--parent-pid", str(os.getpid())], env=env, stdin=subprocess.PIPE)


def _wait_for_workers(store: dist.Store, size: int, processes: list[subprocess.Popen],
                      key, what: str) -> None:
    """Until every worker has set key(rank); the reason of the first that failed or died."""
    pending = set(range(1, size))
    deadline = time.monotonic() + CONNECT_TIMEOUT.total_seconds()
    while pending:
        for rank in sorted(pending):
            if store.check([protocol.failed_key(rank)]):
                failure = json.loads(store.get(protocol.failed_key(rank)))
                error = ValueError if failure["user_error"] else TensorParallelStartupError
                raise error(f"tensor parallel worker {rank}: {failure['message']}")
            if store.check([key(rank)]):
                pending.discard(rank)
        for rank, process in enumerate(processes, start=1):
            if rank in pending and process.poll() is not None:
                raise TensorParallelStartupError(
                    f"tensor parallel worker {rank} (pid {process.pid}) exited with code "
                    f"{process.returncode} while {what}")
        if pending and time.monotonic() > deadline:
            raise TensorParallelStartupError(f"tensor parallel workers {sorted(pending)} did not "
                                             f"answer within {CONNECT_TIMEOUT} while {what}")
        if pending:
            time.sleep(_POLL_S)


def _describe_workers(processes: list[subprocess.Popen]) -> str:
    """The spawned workers that have exited, and how (a moment is given for a dying one)."""
    gone = []
    for rank, process in enumerate(processes, start=1):
        try:
            process.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            continue
        gone.append(f"worker {rank} (pid {process.pid}) exited with code {process.returncode}")
    return "; ".join(gone)


def _stop_workers(store: dist.Store, group: TensorParallelGroup | None,
                  processes: list[subprocess.Popen], workers_started: list[bool]) -> None:
    """Tell the workers to stop (before their runner: through the store; after: in the group),
    give spawned ones a moment to exit and kill those that do not; kill them at once where the
    group is broken (they can no longer be told)."""
    broken = group is not None and group.broken is not None
    try:
        if not workers_started[0]:
            store.set(protocol.RUNNER_KEY, protocol.ABORT)
        elif group is not None and not broken:
            group.broadcast(protocol.stop_header())
    except (TensorParallelError, RuntimeError) as exc:  # the group or the store is gone already
        logger.debug("could not tell the workers to stop: %s", exc)
        broken = True
    deadline = time.monotonic() + (0 if broken else _STOP_WAIT_S)
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdin is not None:
            process.stdin.close()
