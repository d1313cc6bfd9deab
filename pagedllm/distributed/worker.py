"""A tensor-parallel worker: ranks 1..N-1 of an engine whose rank 0 is the engine core.

    python -m pagedllm.distributed.worker     # with MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE

The engine spawns these itself (distributed_executor_backend "mp", with --parent-pid); on other
machines torchrun or a shell starts them (docs/distributed.md). A worker takes the engine's
settings from rank 0 through the store, loads its shard of the model, builds a runner with rank
0's runner's arguments, and then loops: wait for rank 0's next header; run the step packet on its
shard (ModelRunner.execute_packet), or its share of the logits of rows of the last step, or stop.
It samples nothing and keeps no requests: paging, prefix caching, copy-on-write and preemption
are rank 0's decisions, and their effects (block tables, block copies) come in the packets.

It ends when rank 0 says stop (status 0), when the group fails (rank 0 gone, a collective timed
out: status 1), and, when spawned, with the process that spawned it (see driver.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.distributed import protocol
from pagedllm.distributed.group import CONNECT_TIMEOUT, TensorParallelError, TensorParallelGroup, rank_device
from pagedllm.distributed.shard import RankShard
from pagedllm.distributed.sharding import ShardPlan
from pagedllm.kernels import tiers
from pagedllm.model.config import parse_dtype_name
from pagedllm.model.loader import load_model, read_model_config
from pagedllm.utils import die_with_parent
from pagedllm.worker.runner import ModelRunner

logger = logging.getLogger(__name__)



def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    rank = envs.RANK if envs.RANK is not None else -1  # -1: not started by a launcher
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s[tp rank {rank}]: %(message)s")
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the engine decides
    store, rank, size = next(dist.rendezvous("env://", timeout=CONNECT_TIMEOUT))
    store = dist.PrefixStore("pagedllm", store)
    try:
        runner, group = _start(store, rank, size, spawned=args.parent_pid is not None)
    except _Aborted:
        return 1
    except Exception as exc:
        logger.exception("tensor parallel worker %d could not start", rank)
        store.set(protocol.failed_key(rank), json.dumps(
            {"message": str(exc) or repr(exc), "user_error": isinstance(exc, ValueError)}))
        return 1
    try:
        return _serve(runner, group)
    except TensorParallelError as exc:
        logger.error("%s; stopping", exc)
        return 1


class _Aborted(Exception):
    """Rank 0 gave up before this worker's runner was built."""


def _start(store: dist.Store, rank: int, size: int, spawned: bool) -> tuple[ModelRunner, TensorParallelGroup]:
    # Decoded by the fields' types, as the core process decodes its config: a tuple setting arrives
    # as a JSON list and must be a tuple again (EngineConfig(**json.loads(...)) refused it).
    config = msgspec.json.decode(store.get(protocol.CONFIG_KEY), type=EngineConfig)
    store.set(protocol.hello_key(rank), "")
    # Rank 0's device (resolved there) and this rank's place on its machine give this rank's.
    device = rank_device(torch.device(config.device), rank if envs.LOCAL_RANK is None else envs.LOCAL_RANK)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator binds the current device
    group = TensorParallelGroup(store, rank, size, config.distributed_timeout_s, device)
    torch.set_num_threads(int(store.get(protocol.THREADS_KEY)) if spawned else protocol.launched_threads())
    plan = ShardPlan(read_model_config(config.model), size)
    tiers.select(config.cpu_isa, device.type)  # the CPU kernels every layer takes, chosen once
    loaded = load_model(config.model, config.dtype, device, config.quantization,
                        config.quantization_group_size, shard=RankShard(plan, rank, group))
    store.wait([protocol.RUNNER_KEY], timedelta(seconds=CONNECT_TIMEOUT.total_seconds()))
    runner_args = store.get(protocol.RUNNER_KEY).decode()
    if runner_args == protocol.ABORT:
        raise _Aborted
    runner_args = json.loads(runner_args)
    runner_args["kv_dtype"] = parse_dtype_name(runner_args["kv_dtype"])
    # No CUDA graphs on a worker: its steps come as packets (execute_packet), never replayed.
    runner = ModelRunner(loaded.model, device=device, enforce_eager=True, **runner_args)
    store.set(protocol.ready_key(rank), "")
    logger.info("ready: %s", loaded.weights_note)
    return runner, group


def _serve(runner: ModelRunner, group: TensorParallelGroup) -> int:
    """Run rank 0's steps until it says stop."""
    header = torch.empty(protocol.HEADER_LEN, dtype=torch.int64)
    while True:
        group.broadcast(header, idle=True)
        fields = header.tolist()
        kind = fields[0]
        if kind == protocol.STEP:
            layout, table_shape = protocol.read_step_header(fields)
            packet = torch.empty(layout.length, dtype=torch.int64)
            group.broadcast(packet)
            runner.execute_packet(layout, table_shape, packet)
        elif kind == protocol.LOGITS:
            runner.logits_of(fields[1], fields[2])
        elif kind == protocol.STOP:
            return 0
        else:
            raise TensorParallelError(f"unknown message {kind} from rank 0")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.distributed.worker",
                                     description="A tensor-parallel worker (docs/distributed.md); "
                                                 "MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE say "
                                                 "where rank 0 is and which rank this is.")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="(set by the engine that spawns it) exit when that process does")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
