"""The traditional KV layout, for side-by-side measurement: each request reserves one run
of consecutive blocks up front, big enough for the longest it may get.

Same interface as KVCacheManager. The reservation is first fit over the free runs, so
external fragmentation is real: free blocks scattered in small runs cannot take a request.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from pagedllm.config import CONTIGUOUS_RESERVES
from pagedllm.core.kv.block_pool import PendingCopies
from pagedllm.core.kv.manager import NO_HIT, PrefixHit
from pagedllm.core.kv.snapshot import BlockMap, contiguous_block_map
from pagedllm.core.kv.stats import KVStats
from pagedllm.core.request import Request
from pagedllm.utils import cdiv


@dataclass(eq=False)
class _Reservation:
    start: int
    num_blocks: int
    num_used_tokens: int = 0
    ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.ids = list(range(self.start, self.start + self.num_blocks))


class ContiguousKVManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 reserve: str = "max", bytes_per_block: int = 0) -> None:
        if reserve not in CONTIGUOUS_RESERVES:
            raise ValueError(f"reserve must be one of {CONTIGUOUS_RESERVES}; got {reserve!r}")
        if num_blocks < 1 or block_size < 1 or max_model_len < 1:
            raise ValueError("num_blocks, block_size and max_model_len must be positive; got "
                             f"{num_blocks}, {block_size}, {max_model_len}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.reserve = reserve
        self.bytes_per_block = bytes_per_block
        self.enable_prefix_caching = False
        # Free runs as [start, length], sorted by start, never adjacent (merged on free).
        self._free_runs: list[list[int]] = [[0, num_blocks]]
        self._num_free_blocks = num_blocks
        self._reservations: dict[str, _Reservation] = {}
        self._used_slots = 0
        self._pending_copies = PendingCopies()

    # A request reserves its whole length up front: no per-step limit of the cache's.
    max_step_tokens: int | None = None

    def max_tokens_per_request(self, max_chunk_tokens: int) -> int:
        """Whatever the steps, a request reserves its whole length up front."""
        if self.reserve == "max" and cdiv(self.max_model_len, self.block_size) > self.num_blocks:
            return 0  # every request reserves max_model_len, which never fits
        return self.num_blocks * self.block_size

    def reservation_tokens(self, request: Request) -> int:
        """Tokens a request reserves on admission."""
        if self.reserve == "max":
            return self.max_model_len
        max_tokens = request.sampling_params.max_tokens or self.max_model_len
        wanted = min(request.num_prompt_tokens + max_tokens, self.max_model_len)
        return max(wanted, request.num_tokens)

    def find_cached_prefix(self, request: Request) -> PrefixHit:
        return NO_HIT

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       prefix_hit: PrefixHit | None = None) -> bool:
        reservation = self._reservations.get(request.request_id)
        if reservation is None:
            if request.num_computed_tokens:
                raise ValueError(f"request {request.request_id} has computed tokens but no blocks")
            reservation = self._reserve(request.request_id, self.reservation_tokens(request))
            if reservation is None:
                return False
        end = request.num_computed_tokens + num_new_tokens
        if end > reservation.num_blocks * self.block_size:
            raise RuntimeError(f"request {request.request_id} outgrew its contiguous reservation "
                               f"({end} > {reservation.num_blocks * self.block_size} tokens)")
        self._use(reservation, end)
        return True

    def trim(self, request: Request, num_kept_tokens: int) -> None:
        """Count only the first num_kept_tokens slots as used (speculative decoding's rejected
        tokens leave); the reservation itself stays whole, as it always does, so its block list
        is not cut (None, as KVCacheManager.trim returns where nothing went back)."""
        reservation = self._reservations.get(request.request_id)
        if reservation is None:
            raise ValueError(f"cannot trim {request.request_id}: it holds no blocks")
        if not max(1, request.num_computed_tokens) <= num_kept_tokens <= reservation.num_used_tokens:
            raise ValueError(f"cannot trim {request.request_id} to {num_kept_tokens} tokens: it has "
                             f"{request.num_computed_tokens} computed and {reservation.num_used_tokens} "
                             "slots in use")
        self._used_slots -= reservation.num_used_tokens - num_kept_tokens
        reservation.num_used_tokens = num_kept_tokens

    def free(self, request: Request) -> None:
        reservation = self._reservations.pop(request.request_id, None)
        if reservation is None:
            return
        self._used_slots -= reservation.num_used_tokens
        self._release_run(reservation.start, reservation.num_blocks)
        if self._pending_copies:
            freed = range(reservation.start, reservation.start + reservation.num_blocks)
            self._pending_copies.discard_into(freed.__contains__)

    def fork(self, parent: Request, child: Request) -> bool:
        """Reserve a run for the child and copy the parent's used blocks into it; False
        (nothing changed) when no run is free."""
        source = self._reservations.get(parent.request_id)
        if source is None:
            raise ValueError(f"cannot fork {parent.request_id}: it holds no blocks")
        if child.request_id in self._reservations:
            raise ValueError(f"cannot fork into {child.request_id}: it already holds blocks")
        tokens = max(self.reservation_tokens(child), source.num_used_tokens)
        target = self._reserve(child.request_id, tokens)
        if target is None:
            return False
        num_used_blocks = cdiv(source.num_used_tokens, self.block_size)
        for src, dst in zip(source.ids[:num_used_blocks], target.ids):
            self._pending_copies.add(src, dst)
        self._use(target, source.num_used_tokens)
        return True

    def block_ids(self, request: Request) -> list[int]:
        reservation = self._reservations.get(request.request_id)
        return reservation.ids if reservation is not None else []

    def state_pages(self, request: Request) -> list[int]:
        return []  # no recurrent states here (plan.make_kv_manager refuses a hybrid model)

    def take_block_copies(self) -> list[tuple[int, int]]:
        return self._pending_copies.take()

    def reset_prefix_cache(self) -> bool:
        return True

    def block_map(self) -> BlockMap:
        """Every block's state, fill and owner: the dashboard's picture."""
        reservations = ((rid, r.start, r.num_blocks, r.num_used_tokens)
                        for rid, r in self._reservations.items())
        return contiguous_block_map(self.num_blocks, self.block_size, reservations,
                                    self._pending_copies.destinations())

    def stats(self) -> KVStats:
        return KVStats(
            num_blocks=self.num_blocks, num_free_blocks=self._num_free_blocks,
            block_size=self.block_size,
            allocated_slots=(self.num_blocks - self._num_free_blocks) * self.block_size,
            used_slots=self._used_slots, bytes_per_block=self.bytes_per_block)

    @property
    def free_runs(self) -> list[tuple[int, int]]:
        """(start, length) of each free run, by start: the fragmentation, for tests/plots."""
        return [(start, length) for start, length in self._free_runs]

    def _use(self, reservation: _Reservation, end: int) -> None:
        if end > reservation.num_used_tokens:
            self._used_slots += end - reservation.num_used_tokens
            reservation.num_used_tokens = end

    def _reserve(self, request_id: str, num_tokens: int) -> _Reservation | None:
        num_blocks = max(1, cdiv(num_tokens, self.block_size))
        for i, run in enumerate(self._free_runs):  # first fit
            start, length = run
            if length < num_blocks:
                continue
            if length == num_blocks:
                del self._free_runs[i]
            else:
                run[0], run[1] = start + num_blocks, length - num_blocks
            self._num_free_blocks -= num_blocks
            reservation = _Reservation(start, num_blocks)
            self._reservations[request_id] = reservation
            return reservation
        return None

    def _release_run(self, start: int, length: int) -> None:
        runs = self._free_runs
        i = bisect.bisect_left(runs, start, key=lambda run: run[0])
        runs.insert(i, [start, length])
        if i + 1 < len(runs) and runs[i][0] + runs[i][1] == runs[i + 1][0]:
            runs[i][1] += runs.pop(i + 1)[1]
        if i > 0 and runs[i - 1][0] + runs[i - 1][1] == runs[i][0]:
            runs[i - 1][1] += runs.pop(i)[1]
        self._num_free_blocks += length
