"""Turns a scheduler output into the model's flat batch, runs the model, returns logits.

Owns the KV cache tensors and a persistent block table: a request's row is filled once and then
only its newest blocks are written, so per-step upkeep does not grow with context length.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np
import torch

from pagedllm.attention import allocate_kv_cache, copy_blocks
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kv.slots import slot_mapping
from pagedllm.request import Request
from pagedllm.utils import cdiv

logger = logging.getLogger(__name__)


class BlockTable:
    """Rows of physical block ids, one per live request, kept across steps (host memory: each
    step sends the rows it uses to the device with the rest of its metadata)."""

    def __init__(self, num_rows: int, max_blocks_per_seq: int) -> None:
        self.table = np.zeros((num_rows, max_blocks_per_seq), dtype=np.int32)
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
            self.table[row, start:len(block_ids)] = block_ids[start:]
        self._num_synced[request_id] = len(block_ids)
        return row

    def _take_row(self) -> int:
        if not self._free_rows:  # more live requests than rows (forks): grow by doubling
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()


class StepInputs(NamedTuple):
    """One step's model inputs, on the runner's device."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    sample_rows: torch.Tensor  # [S] int64: the row of each sampling request's last new token
    sample_indices: list[int]  # [S]: those requests' indices in the scheduled list


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, num_blocks: int, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 kv_dtype: torch.dtype, device: str | torch.device = "cpu",
                 kv_cache_dtype: str = "auto") -> None:
        cfg = model.config
        self.model = model
        self.device = torch.device(device)
        if self.device.type == "cpu" and hasattr(model, "prepack_for_cpu"):
            model.prepack_for_cpu(max_num_batched_tokens)
        self.block_size = block_size
        self.kv_caches = allocate_kv_cache(cfg.num_hidden_layers, num_blocks, block_size,
                                           cfg.num_key_value_heads, cfg.head_dim, kv_dtype, self.device,
                                           kv_cache_dtype)
        max_blocks_per_seq = cdiv(max_model_len, block_size)
        self.block_table = BlockTable(max_num_seqs, max_blocks_per_seq)
        # A step's integers (token ids, positions, slots, sampled rows, and off the CPU the
        # lengths and block-table rows too) are laid end to end in one host packet, kept across
        # steps. On the CPU the model reads views of it (valid until the next step); elsewhere it
        # goes to the device in one copy, from pinned memory where CUDA is really there (a fake
        # device in tests has none), and the next step waits for that copy before rewriting it.
        self._uploads = self.device.type != "cpu"
        self._pinned = self._uploads and self.device.type == "cuda" and torch.cuda.is_available()
        self._copied = torch.cuda.Event() if self._pinned else None
        self._host = np.zeros(0, dtype=np.int64)
        self._arange = np.zeros(0, dtype=np.int64)
        self._reserve(4 * max_num_batched_tokens, max_num_batched_tokens)

    def drop_requests(self, requests: list[Request]) -> None:
        for request in requests:
            self.block_table.drop(request.request_id)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: give a request its own copy of a block it shared before writing into it."""
        copy_blocks(self.kv_caches, [s for s, _ in copies], [d for _, d in copies])

    @torch.inference_mode()
    def execute(self, scheduled: list) -> tuple[torch.Tensor, list[int]]:
        """Run one step over `scheduled` (ScheduledRequest items). Returns the logits of each
        request that reached the end of its known tokens, and those requests' batch indices."""
        step = self.prepare_inputs(scheduled)
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.attn_metadata)
        if not step.sample_indices:
            return torch.empty(0, device=self.device), []
        return self.model.compute_logits(hidden.index_select(0, step.sample_rows)), step.sample_indices

    def prepare_inputs(self, scheduled: list) -> StepInputs:
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
        seq_lens = starts + counts
        max_blocks = cdiv(int(seq_lens.max()), self.block_size)
        sample_indices = [i for i, s in enumerate(scheduled) if s.samples]
        num_samples = len(sample_indices)
        tail = 2 * n + 1 + n * max_blocks if self._uploads else 0
        self._reserve(3 * num_tokens + num_samples + tail, num_tokens)

        host = self._host
        input_ids = host[:num_tokens]
        if num_tokens == n:  # decodes only: each request's next token
            input_ids[:] = np.fromiter(
                (s.request.token_ids[s.num_computed_tokens] for s in scheduled), np.int64, n)
        else:
            for s, loc in zip(scheduled, query_start_loc[:-1].tolist()):
                input_ids[loc:loc + s.num_new_tokens] = \
                    s.request.token_ids[s.num_computed_tokens:s.num_computed_tokens + s.num_new_tokens]
        # positions: for each request, start .. start + count - 1, laid end to end
        positions = host[num_tokens:2 * num_tokens]
        np.add(self._arange[:num_tokens], np.repeat(starts - query_start_loc[:-1], counts), out=positions)
        table = self.block_table.table
        slot_mapping(table, np.repeat(rows, counts), positions, self.block_size,
                     out=host[2 * num_tokens:3 * num_tokens])
        sample_end = 3 * num_tokens + num_samples
        np.subtract(query_start_loc[1:][sample_indices], 1, out=host[3 * num_tokens:sample_end])

        if self._uploads:
            host[sample_end:sample_end + n] = seq_lens
            host[sample_end + n:sample_end + 2 * n + 1] = query_start_loc
            host[sample_end + 2 * n + 1:sample_end + tail].reshape(n, max_blocks)[:] = \
                table[rows, :max_blocks]
            packet = self._upload(sample_end + tail)
            ints = packet[sample_end:].to(torch.int32)
            seq_lens_t, query_start_loc_t = ints[:n], ints[n:2 * n + 1]
            block_tables = ints[2 * n + 1:].view(n, max_blocks)
        else:
            packet = torch.from_numpy(host[:sample_end])
            seq_lens_t = torch.from_numpy(seq_lens.astype(np.int32))
            query_start_loc_t = torch.from_numpy(query_start_loc.astype(np.int32))
            block_tables = torch.from_numpy(table[rows, :max_blocks])
        meta = AttentionMetadata(
            slot_mapping=packet[2 * num_tokens:3 * num_tokens],
            block_tables=block_tables,
            seq_lens=seq_lens_t,
            query_start_loc=query_start_loc_t,
            seq_lens_cpu=seq_lens.tolist(),
            query_start_loc_cpu=query_start_loc.tolist(),
        )
        return StepInputs(packet[:num_tokens], packet[num_tokens:2 * num_tokens], meta,
                          packet[3 * num_tokens:sample_end], sample_indices)

    def _upload(self, length: int) -> torch.Tensor:
        """The first `length` integers of the host packet, on the device, in one copy."""
        device_packet = self._device_packet[:length]
        device_packet.copy_(self._host_tensor[:length], non_blocking=self._pinned)
        if self._copied is not None:
            self._copied.record()
        return device_packet

    def _reserve(self, packet_len: int, num_tokens: int) -> None:
        """Room for a packet of packet_len integers; and the host packet free to rewrite."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has left the pinned buffer
        if packet_len > len(self._host):
            size = max(packet_len, 2 * len(self._host))
            if self._pinned:
                self._host_tensor = torch.empty(size, dtype=torch.int64, pin_memory=True)
                self._host = self._host_tensor.numpy()
            else:
                self._host = np.zeros(size, dtype=np.int64)
                self._host_tensor = torch.from_numpy(self._host)
            if self._uploads:
                self._device_packet = torch.empty(size, dtype=torch.int64, device=self.device)
        if num_tokens > len(self._arange):
            self._arange = np.arange(max(num_tokens, 2 * len(self._arange)), dtype=np.int64)
