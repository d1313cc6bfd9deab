"""Turns a scheduler output into the model's flat batch, runs the model, returns logits.

Owns the KV cache tensors and a persistent block table (pagedllm.worker.block_table): a request's row is
filled once and then only its newest blocks are written, the batch is ordered by row so that the
kernels read the table's first rows in place, and off the CPU a copy of the table on the device
receives only the changed entries. Per-step upkeep thus does not grow with context length.

Under tensor parallelism (pagedllm.distributed) the runner of rank 0 sends each step's packet to
the workers, whose runners keep their own copy of the table the way a device's is kept
(execute_packet): every rank runs the same step on its shard of the model.

On CUDA, decode steps replay CUDA graphs (pagedllm.worker.cuda_graphs) unless enforce_eager; the
KV cache then has one block more than the KV manager hands out, the graphs' scratch block.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np
import torch

from pagedllm.core.kv.slots import slot_mapping
from pagedllm.core.request import Request
from pagedllm.kernels import compiled
from pagedllm.kernels.attention import allocate_kv_cache, copy_blocks, cpu_attention
from pagedllm.kernels.attention.metadata import AttentionMetadata
from pagedllm.model.batch_invariant import make_batch_invariant
from pagedllm.utils import cdiv
from pagedllm.worker import cuda_graphs
from pagedllm.worker.block_table import BlockTable

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


class StepOutput(NamedTuple):
    """What one model step gives back."""

    # [S, vocab] float32: of each request that reached the end of its known tokens; with
    # execute(argmax_only=True), [S] int64: each such request's argmax token instead.
    logits: torch.Tensor
    sample_indices: list[int]  # [S]: those requests' indices in the scheduled list
    # [T, hidden]: every new token's final hidden state, in the flat batch's order (the engine
    # core turns a prompt's rows into prompt logprobs, for the requests that ask). After a replayed
    # CUDA graph, a view of the graph's output: read it before the next step.
    hidden: torch.Tensor


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, num_blocks: int, block_size: int,
                 max_num_batched_tokens: int, max_model_len: int, kv_dtype: torch.dtype,
                 device: str | torch.device = "cpu", kv_cache_dtype: str = "auto",
                 batch_invariant: bool = False, enforce_eager: bool = False, max_num_seqs: int = 256,
                 graph_capture: cuda_graphs.GraphCapture | None = None) -> None:
        """enforce_eager: no CUDA graphs. graph_capture: what records the decode graphs (None:
        CUDA's, on a CUDA device; tests give a stand-in to run the graph path elsewhere)."""
        cfg = model.config  # under tensor parallelism, this rank's share of the heads
        self.model = model
        self.device = torch.device(device)
        # Rank 0 of a tensor-parallel group: its workers' driver (pagedllm.distributed.driver).
        self.tp = getattr(model, "tensor_parallel", None)
        self.batch_invariant = batch_invariant
        if batch_invariant:  # ValueError where the mode is not covered
            make_batch_invariant(model)
        elif self.device.type == "cpu" and hasattr(model, "prepack_for_cpu"):
            model.prepack_for_cpu(max_num_batched_tokens)
        self.block_size = block_size
        use_graphs = (not enforce_eager and not batch_invariant and self.tp is None
                      and (graph_capture is not None or self.device.type == "cuda"))
        self.kv_caches = allocate_kv_cache(cfg.num_hidden_layers, num_blocks + int(use_graphs), block_size,
                                           cfg.num_key_value_heads, cfg.head_dim, kv_dtype, self.device,
                                           kv_cache_dtype)
        # A step's integers (token ids, positions, slots, sampled rows, and off the CPU the
        # lengths and the block table's changed entries too) are laid end to end in one host
        # packet, kept across steps. On the CPU the model reads views of it (valid until the next
        # step); elsewhere it goes to the device in one copy, from pinned memory where CUDA is
        # really there (a fake device in tests has none), and the next step waits for that copy
        # before rewriting it.
        self._uploads = self.device.type != "cpu"
        # The packet carries the lengths and the table's changes where a copy of the table follows.
        self._packs_table = self._uploads or self.tp is not None
        self.block_table = BlockTable(cdiv(max_model_len, block_size), track_changes=self._packs_table)
        # The device's copy of the block table, following the host's by its changed entries.
        self._device_table = (torch.zeros(self.block_table.table.shape, dtype=torch.int32,
                                          device=self.device) if self._uploads else None)
        self._pinned = self._uploads and self.device.type == "cuda" and torch.cuda.is_available()
        self._copied = torch.cuda.Event() if self._pinned else None
        self._host = np.zeros(0, dtype=np.int64)
        self._arange = np.zeros(0, dtype=np.int64)
        self._reserve(4 * max_num_batched_tokens, max_num_batched_tokens)
        # Which blocks' memory this process has faulted in (CPU, with the compiled kernels): the KV
        # cache is allocated untouched (resident memory grows with use), and a step's first
        # writes into a block fault its pages in one pass before the model runs
        # (_touch_new_blocks), not one page at a time inside the model's kernels: there, each
        # fault stalls both cores, and a first pass over the bench workload ran 9% slower.
        self.touched_blocks = (np.zeros(num_blocks, dtype=bool)
                               if self.device.type == "cpu" and compiled.available() else None)
        self._copies: list[tuple[int, int]] = []  # this step's, for the workers' packet
        self._hidden: torch.Tensor | None = None  # a worker's last step's (for prompt logprobs)
        self.decode_graphs = None
        if use_graphs and (graph_capture is not None
                           or cuda_graphs.attention_captures(self.kv_caches[0], kv_dtype, self.device)):
            self.decode_graphs = cuda_graphs.DecodeGraphs(
                model, self.kv_caches, max_num_seqs=max_num_seqs,
                max_blocks_per_seq=self.block_table.max_blocks_per_seq,
                pad_slot=num_blocks * block_size,  # the scratch block, past the manager's
                device=self.device, capture=graph_capture or cuda_graphs.CudaGraphCapture(self.device))
            self.decode_graphs.capture_all()
        if self.tp is not None:  # the workers build their runners as this one was built
            self.tp.start_workers(dict(
                num_blocks=num_blocks, block_size=block_size,
                max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                kv_dtype=str(kv_dtype).removeprefix("torch."), kv_cache_dtype=kv_cache_dtype))

    def drop_requests(self, requests: list[Request]) -> None:
        for request in requests:
            self.block_table.drop(request.request_id)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: give a request its own copy of a block it shared before writing into it
        (the workers copy theirs with the next step's packet)."""
        copy_blocks(self.kv_caches, [s for s, _ in copies], [d for _, d in copies])
        if self.tp is not None:
            self._copies = copies

    @torch.inference_mode()
    def execute(self, scheduled: list, argmax_only: bool = False) -> StepOutput:
        """Run one step over `scheduled` (ScheduledRequest items): the logits of each request
        that reached the end of its known tokens (argmax_only: just their argmax tokens, what
        greedy sampling with nothing else to read takes), those requests' batch indices, and the
        hidden states of every token."""
        step = self.prepare_inputs(scheduled)
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_replay(step.input_ids.shape[0], step.attn_metadata):
            hidden = graphs.replay(step.input_ids, step.positions, step.attn_metadata)
        else:
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.attn_metadata)
        if not step.sample_indices:
            return StepOutput(torch.empty(0, device=self.device), [], hidden)
        rows = hidden.index_select(0, step.sample_rows)
        logits = self.model.greedy_tokens(rows) if argmax_only else self.model.compute_logits(rows)
        return StepOutput(logits, step.sample_indices, hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Float32 logits [end - start, vocab] of rows start..end of the hidden states the last
        step gave back (the workers compute their vocabulary's share of the same rows)."""
        if self.tp is not None:
            self.tp.send_logits(start, end)
        return self.model.compute_logits(hidden[start:end])

    # -- a tensor-parallel worker's side --------------------------------------------------------
    @torch.inference_mode()
    def execute_packet(self, layout: PacketLayout, table_shape: tuple[int, int],
                       packet: torch.Tensor) -> None:
        """A worker's step: rank 0's packet (host int64s) run on this rank's shard, taking part
        in the collectives rank 0's execute makes; the hidden states are kept for logits_of."""
        copies = packet[layout.copies].view(2, -1).tolist()
        copy_blocks(self.kv_caches, copies[0], copies[1])
        self._touch_new_blocks(packet[layout.slots])
        lengths = packet[layout.lengths].tolist()
        n = layout.num_seqs
        step = self._inputs_from_packet(layout, table_shape, packet.to(self.device), lengths[:n],
                                        lengths[n:], [])
        self._hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.attn_metadata)
        if layout.num_samples:
            self.model.compute_logits(self._hidden.index_select(0, step.sample_rows))

    @torch.inference_mode()
    def logits_of(self, start: int, end: int) -> None:
        """A worker's share of rank 0's compute_logits over rows of the last step."""
        self.model.compute_logits(self._hidden[start:end])

    def _touch_new_blocks(self, slots: np.ndarray | torch.Tensor) -> None:
        """Fault in the blocks this step writes into for the first time (contents kept)."""
        if self.touched_blocks is None:
            return
        blocks = np.asarray(slots) // self.block_size
        new = blocks[~self.touched_blocks[blocks]]
        if new.size:
            new = np.unique(new)
            self.touched_blocks[new] = True
            cpu_attention.touch_blocks(self.kv_caches, torch.from_numpy(new))

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
        changes = self.block_table.take_changes() if self._packs_table else []
        layout = PacketLayout(num_tokens, num_samples, n, sum(end - start for _, start, end in changes),
                              len(self._copies), self._packs_table)
        self._reserve(layout.length, num_tokens)

        host = self._host
        input_ids = host[layout.input_ids]
        if num_tokens == n:  # decodes only: each request's next token
            input_ids[:] = np.fromiter(
                (s.request.token_ids[s.num_computed_tokens] for s in scheduled), np.int64, n)
        else:
            for s, loc in zip(scheduled, query_start_loc[:-1].tolist()):
                input_ids[loc:loc + s.num_new_tokens] = \
                    s.request.token_ids[s.num_computed_tokens:s.num_computed_tokens + s.num_new_tokens]
        # positions: for each request, start .. start + count - 1, laid end to end
        positions = host[layout.positions]
        np.add(self._arange[:num_tokens], np.repeat(starts - query_start_loc[:-1], counts), out=positions)
        table = self.block_table.table
        slot_mapping(table, np.repeat(rows, counts), positions, self.block_size, out=host[layout.slots])
        self._touch_new_blocks(host[layout.slots])
        np.subtract(query_start_loc[1:][sampled], 1, out=host[layout.sample_rows])
        if self._packs_table:
            host[layout.lengths] = np.concatenate([seq_lens, query_start_loc])
            self._pack_changes(changes, host[layout.changes])
            host[layout.copies] = np.array(self._copies, dtype=np.int64).reshape(-1, 2).T.reshape(-1)
            self._copies = []
        if self.tp is not None:
            self.tp.send_step(layout, table.shape, self._host_tensor[:layout.length])

        # The kernels read the table's first n rows in place (every column: they index by
        # position, and a wider row costs nothing).
        if self._uploads:
            return self._inputs_from_packet(layout, table.shape, self._upload(layout.length),
                                            seq_lens.tolist(), query_start_loc.tolist(), sample_indices)
        packet = torch.from_numpy(host[:layout.length])
        meta = AttentionMetadata(
            slot_mapping=packet[layout.slots],
            block_tables=torch.from_numpy(table[:n]),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)),
            seq_lens_cpu=seq_lens.tolist(),
            query_start_loc_cpu=query_start_loc.tolist(),
            batch_invariant=self.batch_invariant,
        )
        return StepInputs(packet[layout.input_ids], packet[layout.positions], meta,
                          packet[layout.sample_rows], sample_indices)

    def _inputs_from_packet(self, layout: PacketLayout, table_shape: tuple[int, int],
                            packet: torch.Tensor, seq_lens: list[int], query_start_loc: list[int],
                            sample_indices: list[int]) -> StepInputs:
        """The step's inputs from its packet on this runner's device, the table copy brought up
        to date by the packet's changed entries (the host table's shape: table_shape)."""
        n = layout.num_seqs
        ints = packet[layout.lengths].to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=packet[layout.slots],
            block_tables=self._update_device_table(packet[layout.changes], table_shape)[:n],
            seq_lens=ints[:n],
            query_start_loc=ints[n:],
            seq_lens_cpu=seq_lens,
            query_start_loc_cpu=query_start_loc,
        )
        return StepInputs(packet[layout.input_ids], packet[layout.positions], meta,
                          packet[layout.sample_rows], sample_indices)

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

    def _update_device_table(self, changes: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """The device's block table (a worker's copy) with this step's changed entries (flat
        indices, then values, on the device) written in; reallocated (contents kept) when the
        host's, now shaped `shape`, grew."""
        if self._device_table is None:
            self._device_table = torch.zeros(shape, dtype=torch.int32, device=self.device)
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
