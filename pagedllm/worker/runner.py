"""One rank's model runner: turns scheduled requests into the model's flat batch, runs the model,
returns logits. Nothing else: the executor (pagedllm.worker.executor) drives it, and under tensor
parallelism sends each step's packet to the workers (pagedllm.distributed.executor).

Owns the KV cache tensors and a persistent block table (pagedllm.worker.block_table): a request's row is
filled once and then only its newest blocks are written, the batch is ordered by row so that the
kernels read the table's first rows in place, and off the CPU a copy of the table on the device
receives only the changed entries. Per-step upkeep thus does not grow with context length.

A step's integers go into one packet (pagedllm.worker.packet), kept in a host buffer that off the
CPU is copied to the device in one copy (pagedllm.worker.upload). Under tensor parallelism rank 0's
runner is built `mirrored`: its packet also carries what the workers' copies of the table and the
KV cache need, and the workers' runners run that packet (execute_packet) on their shards.

On CUDA, decode steps replay CUDA graphs (pagedllm.worker.cuda_graphs) unless enforce_eager; the
KV cache then has one block more than the KV manager hands out, the graphs' scratch block.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch

from pagedllm.core.kv.slots import slot_mapping
from pagedllm.core.request import Request
from pagedllm.kernels import tiers
from pagedllm.kernels.attention import allocate_kv_cache, copy_blocks, cpu_attention
from pagedllm.kernels.attention.metadata import AttentionMetadata
from pagedllm.model.batch_invariant import make_batch_invariant
from pagedllm.model.decode_layers import BurstSpeculation, DecodeLayers
from pagedllm.model.huge_pages import move_weights_to_huge_pages
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.utils import cdiv
from pagedllm.worker import cuda_graphs
from pagedllm.worker.block_table import BlockTable
from pagedllm.worker.packet import PacketLayout, pack_changes, pack_copies
from pagedllm.worker.upload import StepUpload

logger = logging.getLogger(__name__)


class BurstOutput(NamedTuple):
    """A decode burst's tokens, a list per sequence in row order, and with speculation each step
    of each sequence as (row, tokens proposed, proposed tokens kept)."""

    tokens: list[list[int]]
    steps: list[tuple[int, int, int]]


class StepInputs(NamedTuple):
    """One step's model inputs, on the runner's device."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    # [R] int64: the rows whose logits are sampled: each sampling request's last new token's, a
    # speculating request's last 1 + k (ScheduledRequest.num_spec_tokens), in sample_indices' order
    sample_rows: torch.Tensor
    # [S]: those requests' indices in the scheduled list (the batch runs them in block-table row
    # order, which need not be the scheduled order)
    sample_indices: list[int]
    # Each batch row's index in the scheduled list (row i's tokens start at query_start_loc[i]).
    order: list[int] | tuple[()] = ()
    # The host packet the inputs were read from (pagedllm.worker.packet), for the workers.
    layout: PacketLayout | None = None
    table_shape: tuple[int, int] = (0, 0)
    packet: torch.Tensor | None = None

    def token_starts(self) -> list[int]:
        """Where each scheduled request's tokens start in the flat batch, by scheduled index."""
        starts = [0] * len(self.order)
        for row, index in enumerate(self.order):
            starts[index] = self.attn_metadata.query_start_loc_cpu[row]
        return starts


class StepOutput(NamedTuple):
    """What one model step gives back."""

    # [R, vocab] float32: of each request that reached the end of its known tokens (1 + k rows
    # for one that ran k proposed tokens); with execute(argmax_only=True), [R] int64: each such
    # row's argmax token instead.
    logits: torch.Tensor
    sample_indices: list[int]  # [S]: those requests' indices in the scheduled list
    # [T, hidden]: every new token's final hidden state, in the flat batch's order (the executor
    # turns a prompt's rows into prompt logprobs, for the requests that ask). After a replayed
    # CUDA graph, a view of the graph's output: read it before the next step.
    hidden: torch.Tensor


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, num_blocks: int, block_size: int,
                 max_num_batched_tokens: int, max_model_len: int, kv_dtype: torch.dtype,
                 device: str | torch.device = "cpu", kv_cache_dtype: str = "auto",
                 batch_invariant: bool = False, enforce_eager: bool = False, max_num_seqs: int = 256,
                 graph_capture: cuda_graphs.GraphCapture | None = None, mirrored: bool = False,
                 lora: tuple[int, int] | None = None) -> None:
        """enforce_eager: no CUDA graphs. graph_capture: what records the decode graphs (None:
        CUDA's, on a CUDA device; tests give a stand-in to run the graph path elsewhere).
        mirrored: rank 0 of a tensor-parallel group, whose workers keep copies of its block table
        and KV cache from its packets (no CUDA graphs then either). lora: (max_loras, max_rank):
        the model's projections get that many LoRA slots (pagedllm.lora: wrapped before they are
        prepacked), and each step sets which rows use which slot (no CUDA graphs then)."""
        cfg = model.config  # under tensor parallelism, this rank's share of the heads
        self.model = model
        self.device = torch.device(device)
        self.mirrored = mirrored
        self.batch_invariant = batch_invariant
        self.lora_manager = _wrap_for_lora(model, *lora) if lora else None
        if batch_invariant:  # ValueError where the mode is not covered
            make_batch_invariant(model)
        elif self.device.type == "cpu" and hasattr(model, "prepack_for_cpu"):
            model.prepack_for_cpu(max_num_batched_tokens)
        if self.device.type == "cpu":  # before anything takes views of the weights (DecodeLayers)
            move_weights_to_huge_pages(model)
        self.block_size = block_size
        # A hybrid model's recurrent states are read and written around the layers: not in a graph.
        self.recurrent = cfg.is_hybrid
        use_graphs = (not enforce_eager and not batch_invariant and not mirrored and not lora
                      and not self.recurrent
                      and (graph_capture is not None or self.device.type == "cuda"))
        self.kv_caches = allocate_kv_cache(len(cfg.attention_layers), num_blocks + int(use_graphs),
                                           block_size, cfg.num_key_value_heads, cfg.head_dim, kv_dtype,
                                           self.device, kv_cache_dtype,
                                           values_share_keys=cfg.kv_lora_rank > 0)
        self.upload = StepUpload(self.device)
        # The packet carries the lengths and the table's changes where a copy of the table follows.
        self._packs_table = self.upload.uploads or mirrored
        self.block_table = BlockTable(cdiv(max_model_len, block_size), track_changes=self._packs_table)
        self._arange = np.zeros(0, dtype=np.int64)
        self._reserve(4 * max_num_batched_tokens, max_num_batched_tokens)
        # Which blocks' memory this process has faulted in (CPU, with compiled attention): the KV
        # cache is allocated untouched (resident memory grows with use), and a step's first
        # writes into a block fault its pages in one pass before the model runs
        # (_touch_new_blocks), not one page at a time inside the model's kernels: there, each
        # fault stalls both cores, and a first pass over the bench workload ran 9% slower.
        self.touched_blocks = (np.zeros(num_blocks, dtype=bool)
                               if self.device.type == "cpu" and tiers.current().has("attention") else None)
        self._hidden: torch.Tensor | None = None  # a worker's last step's (for prompt logprobs)
        if self.device.type == "cpu" and not batch_invariant and isinstance(model, LlamaForCausalLM):
            model.decode_layers = DecodeLayers.build(model, self.kv_caches)
        self.decode_graphs = None
        if use_graphs and (graph_capture is not None
                           or cuda_graphs.attention_captures(self.kv_caches[0], kv_dtype, self.device,
                                                             sinks=model.config.arch.attention_sinks)):
            self.decode_graphs = cuda_graphs.DecodeGraphs(
                model, self.kv_caches, max_num_seqs=max_num_seqs,
                max_blocks_per_seq=self.block_table.max_blocks_per_seq,
                pad_slot=num_blocks * block_size,  # the scratch block, past the manager's
                device=self.device, capture=graph_capture or cuda_graphs.CudaGraphCapture(self.device))
            self.decode_graphs.capture_all()

    def drop_requests(self, requests: list[Request], trimmed: Mapping[str, int] | None = None) -> None:
        """Forget the rows of requests that finished or were preempted; note the block lists cut
        since the last step (SchedulerOutput.trimmed), so their rows are rewritten from the cut."""
        for request in requests:
            self.block_table.drop(request.request_id)
        for request_id, num_blocks in (trimmed or {}).items():
            self.block_table.cut(request_id, num_blocks)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: give a request its own copy of a block it shared before writing into it
        (a mirrored runner's workers copy theirs with the next step's packet)."""
        copy_blocks(self.kv_caches, [s for s, _ in copies], [d for _, d in copies])

    def execute(self, scheduled: list, argmax_only: bool = False) -> StepOutput:
        """Run one step over `scheduled` (ScheduledRequest items): prepare_inputs, then run."""
        return self.run(self.prepare_inputs(scheduled), argmax_only)

    @torch.inference_mode()
    def run(self, step: StepInputs, argmax_only: bool = False) -> StepOutput:
        """The model over one prepared step: the logits of each request that reached the end of
        its known tokens (argmax_only: just their argmax tokens, what greedy sampling with nothing
        else to read takes), those requests' batch indices, and the hidden states of every
        token."""
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_replay(step.input_ids.shape[0], step.attn_metadata):
            hidden = graphs.replay(step.input_ids, step.positions, step.attn_metadata)
        else:
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.attn_metadata)
        if not step.sample_indices:
            return StepOutput(torch.empty(0, device=self.device), [], hidden)
        rows = hidden.index_select(0, step.sample_rows)
        if self.lora_manager is not None:  # the LM head's adapters: those of the sampled rows
            self.lora_manager.state.select_rows(step.sample_rows)
        logits = self.model.greedy_tokens(rows) if argmax_only else self.model.compute_logits(rows)
        return StepOutput(logits, step.sample_indices, hidden)

    @property
    def runs_bursts(self) -> bool:
        """Whether run_burst may run here: one process on the CPU, without LoRA slots, recurrent
        states or graphs (whose steps need more than the burst's inputs)."""
        return (self.device.type == "cpu" and not self.mirrored and self.lora_manager is None
                and not self.recurrent and self.decode_graphs is None)

    @property
    def speculates_in_bursts(self) -> bool:
        """Whether run_burst may take speculation: its bursts run in one compiled call (where a
        step's metadata lets them: DecodeLayers.bursts)."""
        fused = getattr(self.model, "decode_layers", None)
        return self.runs_bursts and fused is not None and fused.burst_parts is not None

    @torch.inference_mode()
    def run_burst(self, step: StepInputs, speculation: BurstSpeculation | None = None,
                  max_steps: int = 0) -> BurstOutput:
        """A decode burst (pagedllm.engine.decode_burst): a prepared step of decodes whose
        proposals are placeholders run as decode steps one after another, each step's argmax
        tokens the next one's inputs, written into the slots the placeholders took, until each
        sequence filled its slots or max_steps steps ran (0: no limit). In one compiled call
        where the model's decode steps qualify (DecodeLayers.bursts), which also takes
        `speculation` (its ks cut to fit max_burst_rows); the loop below makes the same tokens
        one per step without it. Each sequence's tokens, in row order (sample_indices'), and the
        speculation's steps (BurstOutput)."""
        meta = step.attn_metadata
        starts = meta.query_start_loc_cpu
        n = len(starts) - 1
        counts = [starts[i + 1] - starts[i] for i in range(n)]
        context = [meta.seq_lens_cpu[i] - counts[i] for i in range(n)]  # tokens before the burst
        fused = getattr(self.model, "decode_layers", None)
        if fused is not None and fused.bursts(self.model, self.kv_caches, meta):  # the loop below in C++
            first_ids = step.input_ids.index_select(0, torch.tensor(starts[:-1]))
            if speculation is not None:
                speculation = speculation.within(fused.max_burst_rows)
            return BurstOutput(*fused.burst(first_ids, counts, context, meta, speculation, max_steps))
        tokens: list[list[int]] = [[] for _ in range(n)]
        known = step.input_ids.tolist()
        current = [known[s] for s in starts[:-1]]  # each sequence's known next token
        for j in range(min(max(counts), max_steps or max(counts))):
            active = [i for i in range(n) if counts[i] > j]
            rows = torch.tensor([starts[i] + j for i in active])
            lens = [context[i] + j + 1 for i in active]
            sub = AttentionMetadata(
                slot_mapping=step.attn_metadata.slot_mapping.index_select(0, rows),
                block_tables=meta.block_tables if len(active) == n else meta.block_tables[active],
                seq_lens=torch.tensor(lens, dtype=torch.int32),
                query_start_loc=torch.arange(len(active) + 1, dtype=torch.int32),
                seq_lens_cpu=lens, query_start_loc_cpu=list(range(len(active) + 1)),
                batch_invariant=self.batch_invariant)
            ids = torch.tensor([current[i] for i in active])
            hidden = self.model(ids, step.positions.index_select(0, rows), self.kv_caches, sub)
            for i, token in zip(active, self.model.greedy_tokens(hidden).tolist(), strict=True):
                tokens[i].append(token)
                current[i] = token
        return BurstOutput(tokens, [])

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Float32 logits [end - start, vocab] of rows start..end of the hidden states the last
        step gave back (under tensor parallelism the executor has the workers compute their
        vocabulary's share of the same rows)."""
        if self.lora_manager is not None:
            self.lora_manager.state.select_rows(np.arange(start, end))
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

    def prepare_inputs(self, scheduled: list, copies: list[tuple[int, int]] = ()) -> StepInputs:
        """The step's flat batch, built with numpy in buffers kept across steps: Python loops go
        over requests only (decodes: one list lookup each), never over tokens. copies: the block
        copies before the step, packed for a mirrored runner's workers."""
        scheduled, order = self._in_row_order(scheduled)
        n = len(scheduled)
        counts = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, n)
        if self.lora_manager is not None:  # each token's adapter slot, for the wrapped projections
            slots = np.fromiter((s.request.lora_slot for s in scheduled), np.int64, n)
            self.lora_manager.state.set_batch(np.repeat(slots, counts), self.device)
        starts = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, n)
        rows = np.arange(n)  # _in_row_order put request i in row i
        query_start_loc = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        seq_lens = starts + counts
        sampled = [i for i, s in enumerate(scheduled) if s.samples]  # batch positions
        sample_indices = [order[i] for i in sampled]
        sample_rows = self._sample_rows(scheduled, sampled, query_start_loc)
        num_samples = len(sample_rows)
        changes = self.block_table.take_changes() if self._packs_table else []
        copies = copies if self.mirrored else ()
        layout = PacketLayout(num_tokens, num_samples, n, sum(end - start for _, start, end in changes),
                              len(copies), self._packs_table)
        host = self._reserve(layout.length, num_tokens)
        input_ids = host[layout.input_ids]
        if num_tokens == n:  # decodes only: each request's next token
            input_ids[:] = np.fromiter(
                (s.request.token_ids[s.num_computed_tokens] for s in scheduled), np.int64, n)
        else:
            for s, loc in zip(scheduled, query_start_loc[:-1].tolist()):
                input_ids[loc:loc + s.num_new_tokens] = s.input_token_ids()
        # positions: for each request, start .. start + count - 1, laid end to end
        positions = host[layout.positions]
        np.add(self._arange[:num_tokens], np.repeat(starts - query_start_loc[:-1], counts), out=positions)
        table = self.block_table.table
        slot_mapping(table, np.repeat(rows, counts), positions, self.block_size, out=host[layout.slots])
        self._touch_new_blocks(host[layout.slots])
        host[layout.sample_rows] = sample_rows
        if self._packs_table:
            host[layout.lengths] = np.concatenate([seq_lens, query_start_loc])
            pack_changes(table, changes, host[layout.changes])
            pack_copies(copies, host[layout.copies])
        packet = self.upload.host_tensor[:layout.length]
        sent = dict(order=order, layout=layout, table_shape=table.shape, packet=packet)

        # The kernels read the table's first n rows in place (every column: they index by
        # position, and a wider row costs nothing).
        if self.upload.uploads:
            step = self._inputs_from_packet(layout, table.shape, self.upload.upload(layout.length),
                                            seq_lens.tolist(), query_start_loc.tolist(),
                                            sample_indices)._replace(**sent)
            self._add_state_pages(step.attn_metadata, scheduled)
            return step
        meta = AttentionMetadata(
            slot_mapping=packet[layout.slots],
            block_tables=torch.from_numpy(table[:n]),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)),
            seq_lens_cpu=seq_lens.tolist(),
            query_start_loc_cpu=query_start_loc.tolist(),
            batch_invariant=self.batch_invariant,
        )
        self._add_state_pages(meta, scheduled)
        return StepInputs(packet[layout.input_ids], packet[layout.positions], meta,
                          packet[layout.sample_rows], sample_indices, **sent)

    def _add_state_pages(self, meta: AttentionMetadata, scheduled: list) -> None:
        """A hybrid model's: each request's state pages (batch row order), and which requests start
        from a zero state (their first tokens: new, or preempted and recomputed)."""
        if self.recurrent:
            meta.state_pages = torch.tensor([s.state_pages for s in scheduled], dtype=torch.int64,
                                            device=self.device)
            meta.state_fresh = torch.tensor([s.num_computed_tokens == 0 for s in scheduled],
                                            device=self.device)

    @staticmethod
    def _sample_rows(scheduled: list, sampled: list[int], query_start_loc: np.ndarray) -> np.ndarray:
        """The flat batch's rows whose logits are sampled: each sampling request's last new
        token's; a speculating request's last 1 + k (the token before its proposal and each
        proposed one: their logits verify the proposal and give the token after)."""
        ends = query_start_loc[1:][sampled]
        spec = np.fromiter((scheduled[i].num_spec_tokens for i in sampled), np.int64, len(sampled))
        if not spec.any():
            return ends - 1
        counts = spec + 1
        firsts = np.repeat(ends - counts, counts)
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        return firsts + within

    def _inputs_from_packet(self, layout: PacketLayout, table_shape: tuple[int, int],
                            packet: torch.Tensor, seq_lens: list[int], query_start_loc: list[int],
                            sample_indices: list[int]) -> StepInputs:
        """The step's inputs from its packet on this runner's device, the table copy brought up
        to date by the packet's changed entries (the host table's shape: table_shape)."""
        n = layout.num_seqs
        ints = packet[layout.lengths].to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=packet[layout.slots],
            block_tables=self.upload.update_table(packet[layout.changes], table_shape)[:n],
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

    def _reserve(self, packet_len: int, num_tokens: int) -> np.ndarray:
        """The host packet, free to rewrite, with room for packet_len integers."""
        if num_tokens > len(self._arange):
            self._arange = np.arange(max(num_tokens, 2 * len(self._arange)), dtype=np.int64)
        return self.upload.reserve(packet_len)


def _wrap_for_lora(model: torch.nn.Module, max_loras: int, max_rank: int):
    """The model's LoRA targets wrapped, and the manager of their slots."""
    from pagedllm.lora.layers import wrap_model
    from pagedllm.lora.manager import LoRAManager

    state, wrapped = wrap_model(model, max_loras, max_rank)
    return LoRAManager(state, wrapped, max_loras, max_rank)
