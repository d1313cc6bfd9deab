"""Turns a scheduler output into the model's flat batch, runs the model, returns logits.

Owns the KV cache tensors and a persistent block table: a request's row is filled once and then
only its newest blocks are written, so per-step upkeep does not grow with context length.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from pagedllm.attention import allocate_kv_cache
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kv.slots import slot_mapping
from pagedllm.request import Request
from pagedllm.utils import cdiv

logger = logging.getLogger(__name__)


class BlockTable:
    """Rows of physical block ids, one per live request, kept across steps."""

    def __init__(self, num_rows: int, max_blocks_per_seq: int) -> None:
        self.table = torch.zeros(num_rows, max_blocks_per_seq, dtype=torch.int32)
        self._rows = self.table.numpy()  # the same memory, written without a torch call per row
        self._row_of: dict[str, int] = {}
        self._num_synced: dict[str, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def drop(self, request_id: str) -> None:
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._num_synced.pop(request_id)
            self._free_rows.append(row)

    def sync(self, request_id: str, block_ids: list[int]) -> int:
        """Bring the request's row up to date and return its index. Rewrites from the last
        synced block on, because copy-on-write may have replaced the block being filled."""
        row = self._row_of.get(request_id)
        if row is None:
            row = self._take_row()
            self._row_of[request_id] = row
            self._num_synced[request_id] = 0
        start = max(self._num_synced[request_id] - 1, 0)
        if len(block_ids) > self.table.shape[1]:
            raise ValueError(f"request {request_id} needs {len(block_ids)} blocks; the table holds "
                             f"{self.table.shape[1]} per request (max_model_len too small)")
        if len(block_ids) > start:
            self._rows[row, start:len(block_ids)] = block_ids[start:]
        self._num_synced[request_id] = len(block_ids)
        return row

    def _take_row(self) -> int:
        if not self._free_rows:  # more live requests than rows (forks): grow by doubling
            old = self.table.shape[0]
            self.table = torch.cat([self.table, torch.zeros_like(self.table)])
            self._rows = self.table.numpy()
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, num_blocks: int, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 kv_dtype: torch.dtype, device: str = "cpu") -> None:
        cfg = model.config
        self.model = model
        if str(device) == "cpu" and hasattr(model, "prepack_for_cpu"):
            model.prepack_for_cpu(max_num_batched_tokens)
        self.block_size = block_size
        self.device = device
        self.kv_caches = allocate_kv_cache(cfg.num_hidden_layers, num_blocks, block_size,
                                           cfg.num_key_value_heads, cfg.head_dim, kv_dtype, device)
        max_blocks_per_seq = cdiv(max_model_len, block_size)
        self.block_table = BlockTable(max_num_seqs, max_blocks_per_seq)
        # Step inputs live in preallocated host buffers; tensors are views of their prefixes,
        # valid until the next step.
        self._input_ids = np.zeros(0, dtype=np.int64)
        self._reserve(max_num_batched_tokens)

    def drop_requests(self, requests: list[Request]) -> None:
        for request in requests:
            self.block_table.drop(request.request_id)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: give a request its own copy of a block it shared before writing into it."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for key_cache, value_cache in self.kv_caches:
            key_cache[dst] = key_cache[src]
            value_cache[dst] = value_cache[src]

    @torch.inference_mode()
    def execute(self, scheduled: list) -> tuple[torch.Tensor, list[int]]:
        """Run one step over `scheduled` (ScheduledRequest items). Returns the logits of each
        request that reached the end of its known tokens, and those requests' batch indices."""
        input_ids, positions, meta = self.prepare_inputs(scheduled)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        sample_idx = [i for i, s in enumerate(scheduled) if s.samples]
        if not sample_idx:
            return torch.empty(0), []
        last_rows = torch.tensor([meta.query_start_loc_cpu[i + 1] - 1 for i in sample_idx])
        return self.model.compute_logits(hidden[last_rows]), sample_idx

    def prepare_inputs(self, scheduled: list) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's flat batch, built with numpy in buffers kept across steps: Python loops go
        over requests only (decodes: one list lookup each), never over tokens."""
        n = len(scheduled)
        counts = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, n)
        starts = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, n)
        rows = np.fromiter((self.block_table.sync(s.request.request_id, s.block_ids) for s in scheduled),
                           np.int64, n)
        query_start_loc = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        self._reserve(num_tokens)

        input_ids = self._input_ids[:num_tokens]
        if num_tokens == n:  # decodes only: each request's next token
            input_ids[:] = np.fromiter(
                (s.request.token_ids[s.num_computed_tokens] for s in scheduled), np.int64, n)
        else:
            for s, loc in zip(scheduled, query_start_loc[:-1].tolist()):
                input_ids[loc:loc + s.num_new_tokens] = \
                    s.request.token_ids[s.num_computed_tokens:s.num_computed_tokens + s.num_new_tokens]
        # positions: for each request, start .. start + count - 1, laid end to end
        positions = self._positions[:num_tokens]
        np.add(self._arange[:num_tokens], np.repeat(starts - query_start_loc[:-1], counts), out=positions)
        table = self.block_table.table.numpy()
        slots = slot_mapping(table, np.repeat(rows, counts), positions, self.block_size,
                             out=self._slot_mapping[:num_tokens])

        seq_lens = starts + counts
        max_blocks = cdiv(int(seq_lens.max()), self.block_size)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(self.device),
            block_tables=torch.from_numpy(table[rows, :max_blocks]).to(self.device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(self.device),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(self.device),
            seq_lens_cpu=seq_lens.tolist(),
            query_start_loc_cpu=query_start_loc.tolist(),
        )
        return (torch.from_numpy(input_ids).to(self.device), torch.from_numpy(positions).to(self.device),
                meta)

    def _reserve(self, num_tokens: int) -> None:
        if num_tokens > len(self._input_ids):
            self._input_ids = np.zeros(num_tokens, dtype=np.int64)
            self._positions = np.zeros(num_tokens, dtype=np.int64)
            self._slot_mapping = np.zeros(num_tokens, dtype=np.int64)
            self._arange = np.arange(num_tokens, dtype=np.int64)
