"""The pooler: a pooling request's vector from its prompt's final hidden states (those after the
model's last norm, as transformers' last_hidden_state), chunk by chunk.

A prompt may run in several chunks (chunked prefill), and the vector is due at the last one:
- last: the last token's state, found in the last chunk alone, so a prefix-cache hit (tokens that
  never run) changes nothing;
- mean: the float32 sum of every token's state, kept across chunks and divided at the end; cls:
  the first token's state, kept from the first chunk. Both need every token run, so their engine
  has prefix caching off (EngineConfig.pooling_reads_every_token). A chunk starting at position 0
  starts the request afresh (a recompute after preemption starts there too).
Then a request's PoolingParams: embed cuts to `dimensions` and normalizes; score turns the label
logits at the last token (the label tokens' logits, or a classifier head's: label_logits_of, the
executor's) into probabilities; reward gives a classifier head's logits as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from pagedllm.pooling_params import PoolingParams


class Pooler:
    def __init__(self, pooling_type: str) -> None:
        self.pooling_type = pooling_type
        self._kept: dict[str, torch.Tensor] = {}  # mean: the sum so far; cls: the first state

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop what unfinished chunks kept (the request finished, or was preempted)."""
        for request_id in request_ids:
            self._kept.pop(request_id, None)

    def take_chunk(self, request_id: str, rows: torch.Tensor, first_position: int, num_tokens: int,
                   params: PoolingParams,
                   label_logits_of: Callable[[int], torch.Tensor] | None) -> list[float] | None:
        """One chunk's hidden states rows [n, hidden] of positions first_position ..; the
        request's vector once the chunk reaches num_tokens (else None). label_logits_of(i): a
        score request's float32 label logits at row i."""
        is_last = first_position + rows.shape[0] >= num_tokens
        if params.task in ("score", "reward"):
            if not is_last:
                return None
            label_logits = label_logits_of(rows.shape[0] - 1)
            return self._score(label_logits) if params.task == "score" else label_logits.tolist()
        pooled = self._pool(request_id, rows, first_position, num_tokens, is_last)
        if pooled is None:
            return None
        if params.dimensions is not None:
            pooled = pooled[:params.dimensions]
        if params.normalize:
            pooled = F.normalize(pooled, dim=0)
        return pooled.tolist()

    def _pool(self, request_id: str, rows: torch.Tensor, first_position: int, num_tokens: int,
              is_last: bool) -> torch.Tensor | None:
        if self.pooling_type == "last":
            return rows[-1].float() if is_last else None
        if first_position == 0:
            self._kept.pop(request_id, None)
        elif request_id not in self._kept:
            raise RuntimeError(f"request {request_id}: {self.pooling_type} pooling met a chunk at "
                               f"position {first_position} without the ones before (a prefix-cache hit?)")
        if self.pooling_type == "mean":
            total = rows.float().sum(dim=0)
            before = self._kept.pop(request_id, None)
            if before is not None:
                total += before
            if not is_last:
                self._kept[request_id] = total
                return None
            return total / num_tokens
        first = self._kept.pop(request_id, None)  # cls
        first = rows[0].float().clone() if first is None else first
        if not is_last:
            self._kept[request_id] = first
            return None
        return first

    @staticmethod
    def _score(label_logits: torch.Tensor) -> list[float]:
        """The labels' probabilities among themselves; one label's, its sigmoid (a classifier
        with one output scores relevance so)."""
        if label_logits.numel() == 1:
            return torch.sigmoid(label_logits).tolist()
        return torch.softmax(label_logits, dim=0).tolist()
