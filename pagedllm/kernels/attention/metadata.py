"""What attention needs to know about one flat batch of tokens from many requests."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """One step's batch: T new tokens from B requests, laid end to end.

    Request b's new tokens are rows query_start_loc[b]:query_start_loc[b+1] of the flat batch;
    after this step it has seq_lens[b] tokens in context, so its new tokens sit at positions
    seq_lens[b] - (query_start_loc[b+1] - query_start_loc[b]) .. seq_lens[b] - 1.
    """

    slot_mapping: torch.Tensor  # [T] int64: physical slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32: physical block ids, row b for request b
    seq_lens: torch.Tensor  # [B] int32: context length after this step
    query_start_loc: torch.Tensor  # [B+1] int32: prefix sums of new tokens per request
    # The same numbers as Python ints, so backends can loop without a device sync.
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]
    # Each row's result independent of the rest of the batch (pagedllm.model.batch_invariant).
    batch_invariant: bool = False
    # A hybrid model's recurrent layers (model/recurrent_state.py): each request's state pages
    # [B, pages] int64, and whether it starts from a zero state ([B] bool: its first tokens).
    state_pages: torch.Tensor | None = None
    state_fresh: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_query_len(self) -> int:
        q = self.query_start_loc_cpu
        return max((q[i + 1] - q[i] for i in range(len(q) - 1)), default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)
