"""Turns a scheduler output into the model's flat batch, runs the model, returns logits.

Owns the KV cache tensors and a persistent block table (pagedllm.block_table): a request's row is
filled once and then only its newest blocks are written, the batch is ordered by row so that the
kernels read the table's first rows in place, and off the CPU a copy of the table on the device
receives only the changed entries. Per-step upkeep thus does not grow with context length.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np
import torch

from pagedllm.attention import allocate_kv_cache, copy_blocks
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.block_table import BlockTable
from pagedllm.kv.slots import slot_mapping
from pagedllm.request import Request
from pagedllm.utils import cdiv

logger = logging.getLogger(__name__)


class StepInputs(NamedTuple):
    """One step's model inputs, on the runner's device."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    sample_rows: torch.Tensor  # [S] int64: the row of each sampling request's last new token
    # [S]: those requests' indices in the scheduled list (the batch runs them in block-table row
    # order, which need not be the scheduled order)
    sample_indices: list[int]


class StepOutput(NamedTuple):
    """What one model step gives back."""

    logits: torch.Tensor  # [S, vocab]: of each request that reached the end of its known tokens
    sample_indices: list[int]  # [S]: those requests' indices in the scheduled list
    # [T, hidden]: every new token's final hidden state, in the flat batch's order (the engine
    # core turns a prompt's rows into prompt logprobs, for the requests that ask).
    hidden: torch.Tensor


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, num_blocks: int, block_size: int,
                 max_num_batched_tokens: int, max_model_len: int, kv_dtype: torch.dtype,
                 device: str | torch.device = "cpu", kv_cache_dtype: str = "auto") -> None:
        cfg = model.config
        self.model = model
        self.device = torch.device(device)
        if self.device.type == "cpu" and hasattr(model, "prepack_for_cpu"):
            model.prepack_for_cpu(max_num_batched_tokens)
        self.block_size = block_size
        self.kv_caches = allocate_kv_cache(cfg.num_hidden_layers, num_blocks, block_size,
                                           cfg.num_key_value_heads, cfg.head_dim, kv_dtype, self.device,
                                           kv_cache_dtype)
        # A step's integers (token ids, positions, slots, sampled rows, and off the CPU the
        # lengths and the block table's changed entries too) are laid end to end in one host
        # packet, kept across steps. On the CPU the model reads views of it (valid until the next
        # step); elsewhere it goes to the device in one copy, from pinned memory where CUDA is
        # really there (a fake device in tests has none), and the next step waits for that copy
        # before rewriting it.
        self._uploads = self.device.type != "cpu"
        self.block_table = BlockTable(cdiv(max_model_len, block_size), track_changes=self._uploads)
        # The device's copy of the block table, following the host's by its changed entries.
        self._device_table = (torch.zeros(self.block_table.table.shape, dtype=torch.int32,
                                          device=self.device) if self._uploads else None)
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
    def execute(self, scheduled: list) -> StepOutput:
        """Run one step over `scheduled` (ScheduledRequest items): the logits of each request
        that reached the end of its known tokens, those requests' batch indices, and the hidden
        states of every token."""
        step = self.prepare_inputs(scheduled)
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.attn_metadata)
        if not step.sample_indices:
            return StepOutput(torch.empty(0, device=self.device), [], hidden)
        logits = self.model.compute_logits(hidden.index_select(0, step.sample_rows))
        return StepOutput(logits, step.sample_indices, hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] of hidden states a step gave back."""
        return self.model.compute_logits(hidden)

    def prepare_inputs(self, scheduled: list) -> StepInputs:
        """The step's flat batch, built with numpy in buffers kept across steps: Python loops go
        over requests only (decodes: one list lookup each), never over tokens."""
        scheduled, order = self._in_row_order(scheduled)
        n = len(scheduled)
        counts = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, n)
        starts = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, n)
        rows = np.arange(n)  # _in_row_order put request i in row i
        query_start_loc = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        seq_lens = starts + counts
        sampled = [i for i, s in enumerate(scheduled) if s.samples]  # batch positions
        sample_indices = [order[i] for i in sampled]
        num_samples = len(sample_indices)
        changes = self.block_table.take_changes() if self._uploads else []
        num_changed = sum(end - start for _, start, end in changes)
        tail = 2 * n + 1 + 2 * num_changed if self._uploads else 0
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
        np.subtract(query_start_loc[1:][sampled], 1, out=host[3 * num_tokens:sample_end])

        # The kernels read the table's first n rows in place (every column: they index by
        # position, and a wider row costs nothing).
        if self._uploads:
            host[sample_end:sample_end + n] = seq_lens
            host[sample_end + n:sample_end + 2 * n + 1] = query_start_loc
            changed_at = sample_end + 2 * n + 1
            self._pack_changes(changes, host[changed_at:changed_at + 2 * num_changed])
            packet = self._upload(sample_end + tail)
            ints = packet[sample_end:changed_at].to(torch.int32)
            seq_lens_t, query_start_loc_t = ints[:n], ints[n:2 * n + 1]
            block_tables = self._update_device_table(packet[changed_at:changed_at + 2 * num_changed])[:n]
        else:
            packet = torch.from_numpy(host[:sample_end])
            seq_lens_t = torch.from_numpy(seq_lens.astype(np.int32))
            query_start_loc_t = torch.from_numpy(query_start_loc.astype(np.int32))
            block_tables = torch.from_numpy(table[:n])
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

    def _in_row_order(self, scheduled: list) -> tuple[list, list[int]]:
        """The scheduled requests in block-table row order, in rows 0 .. n - 1, and each one's
        index in `scheduled`. Rows follow the running order except where a request finished
        (the last row moved into its place), so this is usually already the order."""
        table = self.block_table
        rows = [table.sync(s.request.request_id, s.block_ids) for s in scheduled]
        if rows == list(range(len(rows))):
            return scheduled, rows
        order = sorted(range(len(scheduled)), key=rows.__getitem__)
        table.place_first([scheduled[i].request.request_id for i in order])
        return [scheduled[i] for i in order], order

    def _pack_changes(self, changes: list[tuple[int, int, int]], out: np.ndarray) -> None:
        """The changed entries of the host table as flat indices, then their values."""
        table = self.block_table.table
        width = table.shape[1]
        count = len(out) // 2
        if not count:
            return
        index = np.concatenate([np.arange(row * width + start, row * width + end)
                                for row, start, end in changes])
        out[:count] = index
        out[count:] = table.reshape(-1)[index]

    def _update_device_table(self, changes: torch.Tensor) -> torch.Tensor:
        """The device's block table with this step's changed entries (flat indices, then
        values, on the device) written in; reallocated (contents kept) when the host's grew."""
        shape = self.block_table.table.shape
        if self._device_table.shape != shape:
            grown = torch.zeros(shape, dtype=torch.int32, device=self.device)
            rows, cols = self._device_table.shape
            grown[:rows, :cols] = self._device_table
            self._device_table = grown
        count = changes.numel() // 2
        if count:
            self._device_table.view(-1).index_copy_(0, changes[:count], changes[count:].to(torch.int32))
        return self._device_table

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
