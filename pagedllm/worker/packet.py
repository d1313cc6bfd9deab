"""One step's integers laid end to end in one int64 packet, and where each part lies.

The runner builds a step's input ids, positions, slots and sampled rows into one host packet
(kept across steps). Where another copy of the block table follows the host's (a device's copy,
tensor-parallel workers' copies), the packet also carries the lengths and the table's changed
entries, and for the workers the blocks to copy before the step; so a device gets the whole step in
one copy and a worker in one broadcast (pagedllm.distributed.protocol sends the layout ahead).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class PacketLayout(NamedTuple):
    """Where each part of one step's packet of int64s lies: input ids, positions and slots [T
    each], the row of each sampled token [S]; then, where another copy of the block table follows
    the host's (a device's, tensor-parallel workers'), seq_lens [n], query_start_loc [n + 1], the
    table's changed entries (flat indices, then values) [2c] and the blocks to copy before the
    step (sources, then destinations) [2m]."""

    num_tokens: int
    num_samples: int
    num_seqs: int = 0
    num_changed: int = 0
    num_copies: int = 0
    has_tail: bool = False

    @property
    def input_ids(self) -> slice:
        return slice(0, self.num_tokens)

    @property
    def positions(self) -> slice:
        return slice(self.num_tokens, 2 * self.num_tokens)

    @property
    def slots(self) -> slice:
        return slice(2 * self.num_tokens, 3 * self.num_tokens)

    @property
    def sample_rows(self) -> slice:
        return slice(3 * self.num_tokens, 3 * self.num_tokens + self.num_samples)

    @property
    def lengths(self) -> slice:
        """seq_lens, then query_start_loc."""
        start = self.sample_rows.stop
        return slice(start, start + 2 * self.num_seqs + 1)

    @property
    def changes(self) -> slice:
        return slice(self.lengths.stop, self.lengths.stop + 2 * self.num_changed)

    @property
    def copies(self) -> slice:
        return slice(self.changes.stop, self.changes.stop + 2 * self.num_copies)

    @property
    def length(self) -> int:
        return self.copies.stop if self.has_tail else self.sample_rows.stop


def pack_changes(table: np.ndarray, changes: list[tuple[int, int, int]], out: np.ndarray) -> None:
    """The changed entries (row, first column, end column) of a host block table as flat
    indices, then their values, into out (twice their count long)."""
    count = len(out) // 2
    if not count:
        return
    width = table.shape[1]
    index = np.concatenate([np.arange(row * width + start, row * width + end)
                            for row, start, end in changes])
    out[:count] = index
    out[count:] = table.reshape(-1)[index]


def pack_copies(copies: list[tuple[int, int]], out: np.ndarray) -> None:
    """Block copies (source, destination) as their sources, then their destinations."""
    out[:] = np.array(copies, dtype=np.int64).reshape(-1, 2).T.reshape(-1)
