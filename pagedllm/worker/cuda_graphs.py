"""Decode steps replayed from CUDA graphs: one launch of a recorded graph instead of some hundreds
of kernel launches from Python, which is most of a decode step's time at small batches on a GPU.

What is captured: the model's forward pass (embeddings, every layer, the final norm) of a
decode-only step, one token per request, for each batch size in `capture_sizes` (1, 2, 4, 8, then
every 16 up to max_num_seqs or 256), all sharing one memory pool, largest first. The LM head,
sampling and everything after run eagerly on the rows that sample, as before.

How a graph stays valid. A graph replays fixed kernels on fixed addresses, so every tensor the
forward pass reads lives here, allocated once at its largest size: input ids, positions, slots,
seq_lens, query_start_loc and a block table of max_model_len / block_size columns. Before each
replay the step's values (on the device already, from the runner's upload) are copied into them in
place: a few small copies, then the graph. A step of n requests runs the graph of the next size
B >= n; rows n..B-1 are padding: seq_len 0 (attention reads nothing for them) and a slot in a
scratch block the runner allocates past the KV manager's blocks, which no request ever owns, so
their K/V writes land nowhere that is read. The output is the graph's own buffer: rows [0, n) of
it, valid until the next replay (the runner reads them within the step).

What may be captured: only what reads no value on the host during the forward pass. The Triton
attention kernel takes everything from device tensors; the portable torch path loops over the
host's seq_lens, so graphs are used only where CUDA attention is the Triton kernel
(attention_captures; never for attention sinks, which take the torch path). Rope types whose
frequencies change past a length (dynamic NTK, LongRoPE) choose on the host: steps past that
length run eagerly. So do prefill chunks, batches above the largest size, tensor parallelism (its
collectives are not captured) and `--enforce-eager` (EngineConfig.enforce_eager, vLLM's flag).

Capture writes nothing a request reads: the warm-up runs (Triton compiling, cuBLAS choosing its
kernels, quantized layers reading their codebooks) and the captures see padding rows only.

GraphCapture is the seam tests use: CudaGraphCapture records real graphs; on a machine without a
GPU, tests give a stand-in that reruns the forward pass on the same static buffers into the same
output, which finds a value baked in at capture (a host list, a buffer that moved) as a real graph
would.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from pagedllm.kernels.attention.metadata import AttentionMetadata
from pagedllm.model.rope import RotaryEmbedding

logger = logging.getLogger(__name__)

# The largest batch captured: beyond it a decode step is long enough that launches matter little.
MAX_CAPTURE_SIZE = 256


def capture_sizes(max_num_seqs: int, largest: int = MAX_CAPTURE_SIZE) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every 16, up to the first at or above
    min(max_num_seqs, largest) (so that every batch the scheduler can make up to there has one)."""
    limit = min(max_num_seqs, largest)
    sizes = [1, 2, 4, 8] + list(range(16, largest + 1, 16))
    return sizes[:bisect.bisect_left(sizes, limit) + 1]


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_seqs requests (None: none does)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class GraphCapture(Protocol):
    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Record forward(); return what replays it and the tensor each replay writes into."""


class CudaGraphCapture:
    """Real CUDA graphs, all in one memory pool (a smaller batch's graph reuses a larger one's
    memory: only one replays at a time)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device), torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        return graph.replay, out


def attention_captures(kv_cache, dtype: torch.dtype, device: torch.device, sinks: bool = False) -> bool:
    """Whether the attention the dispatcher takes for this cache on this device reads everything
    from device tensors: the Triton kernel, for CUDA tensors it supports, and not for a model with
    attention sinks (gpt-oss: the torch path on every device)."""
    if device.type != "cuda" or sinks:
        return False
    from pagedllm.kernels import attention

    kernel = attention._triton_attention()
    num_kv_heads, head_dim = kv_cache[0].shape[2], kv_cache[0].shape[3]
    probe = torch.empty(1, num_kv_heads, head_dim, dtype=dtype, device=device)
    return kernel is not None and kernel.supports(probe, kv_cache[0])


class DecodeGraphs:
    """The captured decode steps of one model and KV cache, and the static buffers they read."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, *, max_num_seqs: int,
                 max_blocks_per_seq: int, pad_slot: int, device: torch.device,
                 capture: GraphCapture, sizes: list[int] | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sizes or capture_sizes(max_num_seqs)
        self.pad_slot = pad_slot
        self._capture = capture
        largest = self.sizes[-1]
        ints = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(largest, **ints)
        self.positions = torch.zeros(largest, **ints)
        self.slot_mapping = torch.full((largest,), pad_slot, **ints)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        # One new token per request: query_start_loc is 0, 1, 2, ... whatever the step.
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(largest, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self.length_limit = min((m.length_limit for m in model.modules()
                                 if isinstance(m, RotaryEmbedding) and m.length_limit is not None),
                                default=None)
        self.num_replays = 0

    def capture_all(self) -> None:
        """Warm up and capture every size, largest first (the smaller ones reuse its memory)."""
        started = time.perf_counter()
        with torch.inference_mode():
            for size in reversed(self.sizes):
                self._pad_from(0, size)
                forward = self._forward_of(size)
                forward()  # compiles, chooses kernels, prepares layers: all eagerly
                self.graphs[size] = self._capture.capture(forward)
        logger.info("captured CUDA graphs of decode steps for batch sizes %s in %.1f s",
                    self.sizes, time.perf_counter() - started)

    def can_replay(self, num_tokens: int, attn_metadata: AttentionMetadata) -> bool:
        """Whether this step is one the graphs run: decodes only, few enough, no request past the
        length where the rope's frequencies change."""
        num_seqs = attn_metadata.num_seqs
        return (num_tokens == num_seqs and 0 < num_seqs <= self.sizes[-1] and bool(self.graphs)
                and (self.length_limit is None or attn_metadata.max_seq_len <= self.length_limit))

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor,
               attn_metadata: AttentionMetadata) -> torch.Tensor:
        """The step's hidden states [n, hidden]: its inputs copied into the static buffers, the
        graph of the next size replayed. A view of the graph's output, valid until the next."""
        n = attn_metadata.num_seqs
        size = padded_size(n, self.sizes)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(attn_metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(attn_metadata.seq_lens, non_blocking=True)
        table = attn_metadata.block_tables
        self.block_tables[:n, :table.shape[1]].copy_(table, non_blocking=True)
        self._pad_from(n, size)
        replay, out = self.graphs[size]
        replay()
        self.num_replays += 1
        return out[:n]

    def _pad_from(self, n: int, size: int) -> None:
        """Rows n..size-1 made padding: nothing to attend to, K/V written to the scratch slot."""
        if n < size:
            self.slot_mapping[n:size].fill_(self.pad_slot)
            self.seq_lens[n:size].zero_()

    def _forward_of(self, size: int) -> Callable[[], torch.Tensor]:
        """The model over the first `size` rows of the static buffers: what a graph records. Its
        views are taken once, here, as a graph binds addresses once."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[:size + 1],
            # Host copies for code that reads them: every step replayed has one token a request
            # and no request past length_limit (can_replay), which is all these stand for.
            seq_lens_cpu=[1] * size, query_start_loc_cpu=list(range(size + 1)))
        input_ids, positions = self.input_ids[:size], self.positions[:size]
        return lambda: self.model(input_ids, positions, self.kv_caches, meta)
