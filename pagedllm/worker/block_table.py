"""The runner's block table: one row of physical block ids per live request, kept across steps in
host memory (numpy, int32), laid out so that a step's table costs the same at 1k and 1M tokens.

- Rows follow the batch: live requests hold rows 0 .. num_live - 1 (a dropped request's row takes
  the last live row), and the runner orders each step's batch by row. A step that runs every live
  request (every decode step) then reads rows [0, n) as a view: no per-step copy of the table,
  whose rows grow with context. Only a step that skips a live request moves rows (two per skipped
  one, once), so that the step's requests sit in rows [0, n).
- Only what changed is written: a row is filled once, then each step rewrites from its last
  synced entry (copy-on-write may have replaced the block being filled) and marks the entries the
  KV manager gave back (sliding window holes, always at the front) as NULL_BLOCK. A list cut at
  its end (a speculative step's rejected slots, `cut`) is rewritten from the cut on its next
  sync: by then it may have grown again with other blocks.
- With track_changes, every write is recorded as (row, first column, end column), so a copy of the
  table on a device follows with only the changed entries (ModelRunner scatters them).
- The table grows by doubling, in rows with the live requests and in width with the longest one,
  so it takes about (live requests) x (longest request's blocks) x 4 bytes, not
  max_num_seqs x max_model_len / block_size: 64 MiB for 256 rows at 1M tokens of 16-token blocks,
  reserved whatever the requests, would otherwise be.
"""

from __future__ import annotations

import numpy as np

from pagedllm.core.kv.manager import NULL_BLOCK

_FIRST_ROWS = 8
_FIRST_WIDTH = 64


class BlockTable:
    def __init__(self, max_blocks_per_seq: int, track_changes: bool = False) -> None:
        self.max_blocks_per_seq = max_blocks_per_seq
        self.table = np.zeros((_FIRST_ROWS, min(_FIRST_WIDTH, max_blocks_per_seq)), dtype=np.int32)
        self._row_of: dict[str, int] = {}
        self._request_at: list[str] = []  # the request id in each live row
        self._num_synced: list[int] = []  # per live row: entries written from its block list
        self._num_holes: list[int] = []  # per live row: leading entries written as NULL_BLOCK
        self._track_changes = track_changes
        self.changes: list[tuple[int, int, int]] = []  # (row, start, end), when tracked

    @property
    def num_live(self) -> int:
        return len(self._request_at)

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    def row_of(self, request_id: str) -> int | None:
        return self._row_of.get(request_id)

    def drop(self, request_id: str) -> None:
        """Forget a request; the last live row moves into its row."""
        row = self._row_of.pop(request_id, None)
        if row is None:
            return
        last = self.num_live - 1
        if row != last:
            self._move(last, row)
        self._request_at.pop()
        self._num_synced.pop()
        self._num_holes.pop()

    def cut(self, request_id: str, num_blocks: int) -> None:
        """The request's block list was cut to its first num_blocks (pagedllm.core.scheduler's
        `trimmed`): the next sync rewrites the row from there, whatever the list's length then."""
        row = self._row_of.get(request_id)
        if row is not None:
            self._num_synced[row] = min(self._num_synced[row], num_blocks)

    def sync(self, request_id: str, block_ids: list[int]) -> int:
        """Bring the request's row up to date with its block list (the KV manager's live list)
        and return its index."""
        num_blocks = len(block_ids)
        if num_blocks > self.max_blocks_per_seq:
            raise ValueError(f"request {request_id} needs {num_blocks} blocks; the table holds "
                             f"{self.max_blocks_per_seq} per request (max_model_len too small)")
        row = self._row_of.get(request_id)
        if row is None:
            row = self._add_row(request_id)
        if num_blocks > self.table.shape[1]:
            self._grow(self.table.shape[0], num_blocks)
        start = max(self._num_synced[row] - 1, 0)
        if num_blocks > start:
            self.table[row, start:num_blocks] = block_ids[start:]
            self._changed(row, start, num_blocks)
        self._num_synced[row] = num_blocks
        holes = self._num_holes[row]
        if holes < start and block_ids[holes] == NULL_BLOCK:  # given back since the last step
            end = holes
            while end < start and block_ids[end] == NULL_BLOCK:
                end += 1
            self.table[row, holes:end] = NULL_BLOCK
            self._changed(row, holes, end)
            self._num_holes[row] = end
        return row

    def place_first(self, request_ids: list[str]) -> None:
        """Put these requests (rows in increasing order) in rows 0 .. len - 1, swapping each
        one that sits further down with the live request above it that is not among them."""
        for i, request_id in enumerate(request_ids):
            row = self._row_of[request_id]
            if row != i:
                self._swap(i, row)

    def take_changes(self) -> list[tuple[int, int, int]]:
        changes, self.changes = self.changes, []
        return changes

    # -- rows --------------------------------------------------------------------------------------
    def _add_row(self, request_id: str) -> int:
        row = self.num_live
        if row == self.table.shape[0]:
            self._grow(2 * row, self.table.shape[1])
        self._row_of[request_id] = row
        self._request_at.append(request_id)
        self._num_synced.append(0)
        self._num_holes.append(0)
        return row

    def _move(self, src: int, dst: int) -> None:
        """Row src's request into row dst (whose request is gone)."""
        request_id = self._request_at[src]
        synced = self._num_synced[src]
        self.table[dst, :synced] = self.table[src, :synced]
        self._changed(dst, 0, synced)
        self._row_of[request_id] = dst
        self._request_at[dst] = request_id
        self._num_synced[dst] = synced
        self._num_holes[dst] = self._num_holes[src]

    def _swap(self, a: int, b: int) -> None:
        width = max(self._num_synced[a], self._num_synced[b])
        self.table[[a, b], :width] = self.table[[b, a], :width]
        for row in (a, b):
            self._changed(row, 0, width)
        for values in (self._request_at, self._num_synced, self._num_holes):
            values[a], values[b] = values[b], values[a]
        self._row_of[self._request_at[a]] = a
        self._row_of[self._request_at[b]] = b

    def _grow(self, num_rows: int, min_width: int) -> None:
        width = self.table.shape[1]
        while width < min_width:
            width = min(2 * width, self.max_blocks_per_seq)
        grown = np.zeros((num_rows, width), dtype=np.int32)
        rows, cols = self.table.shape
        grown[:rows, :cols] = self.table
        self.table = grown

    def _changed(self, row: int, start: int, end: int) -> None:
        if self._track_changes and end > start:
            self.changes.append((row, start, end))
