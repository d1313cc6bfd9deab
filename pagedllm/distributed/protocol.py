"""What rank 0 and its workers say to each other.

At start-up, through the store (torch.distributed's key-value store, served by rank 0 or by
torchrun's agent): rank 0 puts the engine's settings (CONFIG_KEY) and the torch threads each rank
uses; each worker says it is there (hello), loads its shard, waits for the runner's arguments
(RUNNER_KEY, once rank 0 planned its KV cache) and says it is ready, or why it failed.

Then, every step, over the group: one header of HEADER_LEN int64s broadcast from rank 0 (what
comes next), and for a step the packet of its integers (pagedllm.worker.packet); then the step's
collectives, the same on every rank.
"""

from __future__ import annotations

import torch

from pagedllm import envs
from pagedllm.worker.packet import PacketLayout

HEADER_LEN = 8
STEP, LOGITS, STOP = 1, 2, 3  # header[0]

CONFIG_KEY = "config"  # the EngineConfig, as JSON
THREADS_KEY = "threads"  # torch threads of each spawned rank
RUNNER_KEY = "runner"  # the ModelRunner's arguments as JSON, or ABORT: rank 0 gave up


ABORT = "abort"


def hello_key(rank: int) -> str:
    return f"hello/{rank}"


def ready_key(rank: int) -> str:
    return f"ready/{rank}"


def failed_key(rank: int) -> str:
    """Why the worker could not start: JSON {"message", "user_error"}."""
    return f"failed/{rank}"


def step_header(layout: PacketLayout, table_shape: tuple[int, int]) -> torch.Tensor:
    return torch.tensor([STEP, layout.num_tokens, layout.num_samples, layout.num_seqs,
                         layout.num_changed, layout.num_copies, *table_shape], dtype=torch.int64)


def logits_header(start: int, end: int) -> torch.Tensor:
    return torch.tensor([LOGITS, start, end] + [0] * (HEADER_LEN - 3), dtype=torch.int64)


def stop_header() -> torch.Tensor:
    return torch.tensor([STOP] + [0] * (HEADER_LEN - 1), dtype=torch.int64)


def read_step_header(header: list[int]) -> tuple[PacketLayout, tuple[int, int]]:
    _, tokens, samples, seqs, changed, copies, rows, width = header
    return PacketLayout(tokens, samples, seqs, changed, copies, has_tail=True), (rows, width)


def threads_per_rank(ranks_here: int) -> int:
    """Torch threads for each of the ranks_here ranks on this machine: the cores shared out
    (on two cores and two ranks, one each)."""
    return max(1, torch.get_num_threads() // ranks_here)


def launched_threads() -> int:
    """Torch threads for a rank started by a launcher: the machine's cores shared out between
    torchrun's LOCAL_WORLD_SIZE ranks where it set one, else all of them (one rank a machine).
    (Ranks the engine spawned take rank 0's THREADS_KEY.)"""
    return threads_per_rank(envs.LOCAL_WORLD_SIZE)
