"""Where a token's K/V lives: physical slot = block id * block_size + offset in the block.

The one place that turns positions into slots: the runner uses it for each step's batch, and
tests and benches that lay out batches by hand use it too. numpy, no torch.
"""

from __future__ import annotations

import numpy as np


def slot_mapping(block_tables: np.ndarray, rows: np.ndarray, positions: np.ndarray,
                 block_size: int, out: np.ndarray | None = None) -> np.ndarray:
    """The physical slot of each token: token i sits at positions[i] of the request whose block
    table is block_tables[rows[i]]. Written into `out` (int64) when given."""
    blocks = block_tables[rows, positions // block_size]
    slots = np.multiply(blocks, block_size, out=out, casting="unsafe", dtype=np.int64)
    slots += positions % block_size
    return slots


def request_slots(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The slots of one request's positions start .. end - 1."""
    positions = np.arange(start, end, dtype=np.int64)
    table = np.asarray([block_ids], dtype=np.int64)
    return slot_mapping(table, np.zeros_like(positions), positions, block_size).tolist()
