"""The KV side of speculative decoding: proposed tokens take slots like any others and give them back
when rejected (KVCacheManager.trim), never in a shared or cached block, and prefix-cache hashes
cover accepted tokens only.

Hand-written cases pin exact block ids; random streams of add / speculative step / accept j /
abort / fork / preempt keep every invariant, reading every context back through the simulated
runner (tests/core/kv/sim.py) so that stale K/V of a rejected proposal is caught where read.

The harness schedules as the integration will (pagedllm.spec_decode's docstring): a request whose
step reaches the end of its known tokens may also run k proposed tokens (request.spec_token_ids);
short of blocks, proposals are dropped before anyone is preempted; after the step, j of them are
accepted, num_computed_tokens counts the accepted ones only, and trim() gives back the rest.
"""

from __future__ import annotations

import itertools
from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.core.kv import ContiguousKVManager, KVCacheManager
from pagedllm.core.kv.manager import NULL_BLOCK
from pagedllm.core.request import Request
from pagedllm.core.scheduler import ScheduledRequest, SchedulerOutput
from pagedllm.utils import cdiv
from tests.core.kv.sim import SimRunner, check_manager, new_token_slots

# -- by hand, exact block ids ------------------------------------------------------------------


def _prefilled(manager: KVCacheManager, request_id: str, prompt: list[int], sampled: int) -> Request:
    """A request whose prompt ran in one step and whose first token was sampled."""
    request = Request(request_id, prompt)
    assert manager.allocate_slots(request, len(prompt), manager.find_cached_prefix(request))
    request.num_computed_tokens = len(prompt)
    request.append_token(sampled)
    return request


def _verify(manager: KVCacheManager, request: Request, proposal: list[int], accepted: int,
            next_token: int) -> int | None:
    """After a step that ran the request's last token and `proposal`: keep `accepted` of them
    (trim's answer: the blocks kept where some went back)."""
    request.num_computed_tokens += 1 + accepted
    for token in [*proposal[:accepted], next_token]:
        request.append_token(token)
    return manager.trim(request, request.num_computed_tokens)


def test_rejected_tokens_give_back_their_blocks_and_the_next_step_takes_them_again():
    manager = KVCacheManager(8, 4)
    request = _prefilled(manager, "a", [1, 2, 3, 4, 5, 6], sampled=7)
    assert manager.block_ids(request) == [0, 1]
    # Position 6 (the sampled token) and four proposals, positions 7 .. 10.
    assert manager.allocate_slots(request, 1 + 4)
    assert manager.block_ids(request) == [0, 1, 2]
    assert manager.stats().used_slots == 11
    assert _verify(manager, request, [8, 9, 10, 11], accepted=1, next_token=20) == 2  # positions 0 .. 7 kept
    assert manager.block_ids(request) == [0, 1]
    assert manager.pool.blocks[1].num_filled == 4 and manager.stats().used_slots == 8
    assert [b.block_id for b in manager.pool.free_queue][:1] == [2]  # first in line again
    assert manager.allocate_slots(request, 1 + 2)
    assert manager.block_ids(request) == [0, 1, 2]
    assert _verify(manager, request, [21, 22], accepted=0, next_token=30) is None  # positions 0 .. 8 kept
    assert manager.block_ids(request) == [0, 1, 2]  # the tail keeps its one kept token
    assert manager.pool.blocks[2].num_filled == 1 and manager.stats().used_slots == 9
    assert request.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 20, 30]
    manager.free(request)
    assert manager.stats().num_free_blocks == 8 and manager.stats().used_slots == 0


def test_only_blocks_of_accepted_tokens_are_cached():
    manager = KVCacheManager(8, 4, enable_prefix_caching=True)
    request = _prefilled(manager, "a", [1, 2, 3, 4, 5, 6], sampled=7)
    assert manager.allocate_slots(request, 1 + 3)  # positions 6 .. 9 in blocks 1, 2
    _verify(manager, request, [8, 9, 10], accepted=0, next_token=50)  # 7 computed: block 1 is not
    assert manager.allocate_slots(request, 1)  # caches what is computed whole: block 0 only
    assert [b.block_id for b in manager.pool.blocks if b.is_cached] == [0]
    assert manager.pool.blocks[1].num_filled == 4  # position 7 now holds the accepted 50
    request.num_computed_tokens += 1
    request.append_token(51)
    assert manager.allocate_slots(request, 1)  # block 1 is computed whole: cached, with 50 in it
    cached = manager.pool.blocks[1]
    assert cached.is_cached and cached.cache_tokens == (5, 6, 7, 50)
    # A later request with the same accepted prefix hits both blocks; one that continued with the
    # rejected proposal (8) hits the first only.
    same = Request("b", [1, 2, 3, 4, 5, 6, 7, 50, 51])
    other = Request("c", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert [b.block_id for b in manager.find_cached_prefix(same).blocks] == [0, 1]
    assert [b.block_id for b in manager.find_cached_prefix(other).blocks] == [0]


def test_a_forked_child_speculates_into_its_own_copy():
    manager = KVCacheManager(8, 4)
    parent = _prefilled(manager, "p", [1, 2, 3, 4, 5, 6], sampled=7)  # blocks [0, 1], 1 half full
    child = Request("c", [1, 2, 3, 4, 5, 6])
    child.append_token(9)
    manager.fork(parent, child)
    child.num_computed_tokens = 6
    assert manager.pool.blocks[1].ref_cnt == 2
    assert manager.allocate_slots(child, 1 + 3)  # writes positions 6 .. 9: block 1 is copied first
    assert manager.block_ids(child) == [0, 2, 3]
    assert manager.take_block_copies() == [(1, 2)]
    assert manager.pool.blocks[1].ref_cnt == 1 and manager.pool.blocks[1].num_filled == 2
    _verify(manager, child, [10, 11, 12], accepted=0, next_token=13)
    assert manager.block_ids(child) == [0, 2] and manager.block_ids(parent) == [0, 1]
    assert manager.pool.blocks[2].num_filled == 3 and manager.pool.blocks[1].num_filled == 2
    check_manager(manager)


def test_trim_refuses_what_would_lose_computed_or_shared_tokens():
    manager = KVCacheManager(8, 4)
    with pytest.raises(ValueError, match="holds no blocks"):
        manager.trim(Request("x", [1]), 1)
    request = _prefilled(manager, "a", [1, 2, 3, 4, 5, 6], sampled=7)
    with pytest.raises(ValueError, match="6 computed"):
        manager.trim(request, 5)
    with pytest.raises(ValueError, match="slots for 8"):
        manager.trim(request, 9)
    assert manager.trim(request, 6) is None  # nothing to give back: a no-op
    assert manager.block_ids(request) == [0, 1]
    # A shared block filled past the cut (only a step that skipped copy-on-write could do that).
    child = Request("c", [1, 2, 3, 4, 5, 6])
    child.append_token(7)
    manager.fork(request, child)
    request.num_computed_tokens = 4
    with pytest.raises(ValueError, match="shared"):
        manager.trim(request, 5)


def test_trim_keeps_a_sliding_windows_holes():
    manager = KVCacheManager(8, 2, sliding_window=2)
    request = _prefilled(manager, "a", [1, 2, 3, 4, 5], sampled=6)
    assert manager.allocate_slots(request, 1 + 3)  # positions 5 .. 8; blocks before 4 are out
    assert manager.block_ids(request)[:2] == [NULL_BLOCK, NULL_BLOCK]
    _verify(manager, request, [7, 8, 9], accepted=1, next_token=10)  # 7 computed
    assert manager.block_ids(request)[:2] == [NULL_BLOCK, NULL_BLOCK]
    assert len(manager.block_ids(request)) == cdiv(7, 2)
    check_manager(manager)


def test_contiguous_trim_counts_used_slots_only():
    manager = ContiguousKVManager(8, 4, max_model_len=16)
    request = Request("a", [1, 2, 3])
    assert manager.allocate_slots(request, 3)
    request.num_computed_tokens = 3
    request.append_token(4)
    assert manager.allocate_slots(request, 1 + 3)
    assert manager.stats().used_slots == 7
    manager.trim(request, 5)
    assert manager.stats().used_slots == 5 and manager.block_ids(request) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="3 computed"):
        manager.trim(request, 6)  # past what is in use


# -- random streams ------------------------------------------------------------------------------

EOS = 0


class SpecHarness:
    def __init__(self, data, prefix: bool, window: bool) -> None:
        self.draw = data.draw
        self.block_size = self.draw(st.sampled_from([1, 2, 2, 4, 4, 8]), "block_size")
        self.max_model_len = self.draw(st.integers(6, 40), "max_model_len")
        per_request = cdiv(self.max_model_len, self.block_size)
        num_blocks = self.draw(st.integers(per_request, 2 * per_request + 2), "num_blocks")
        self.chunk = self.draw(st.integers(1, 24), "chunk")  # tokens a prefill step computes
        self.max_k = self.draw(st.integers(1, 6), "max_k")
        self.max_seqs = self.draw(st.integers(1, 4), "max_seqs")
        sliding = self.draw(st.integers(1, self.max_model_len), "window") if window else None
        self.manager = KVCacheManager(num_blocks, self.block_size, enable_prefix_caching=prefix,
                                      sliding_window=sliding)
        self.runner = SimRunner(num_blocks, self.block_size, sliding)
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.ids = itertools.count()
        self.prompts: list[list[int]] = []

    # -- requests ----------------------------------------------------------------------------
    def add(self) -> None:
        base: list[int] = []
        if self.prompts and self.draw(st.booleans(), "extend"):
            earlier = self.draw(st.sampled_from(self.prompts), "earlier")
            base = earlier[:self.draw(st.integers(0, len(earlier)), "cut")]
        extra = self.draw(st.lists(st.integers(1, 3), max_size=self.max_model_len // 2), "tail")
        prompt = (base + extra)[:self.max_model_len - 1] or [1]
        self.prompts.append(prompt)
        self.waiting.append(Request(f"r{next(self.ids)}", prompt,
                                    cache_salt=self.draw(st.sampled_from([None, "s"]), "salt")))

    def abort(self) -> None:
        live = self.running + list(self.waiting)
        if live:
            request = self.draw(st.sampled_from(live), "abort")
            self._drop(request)

    def preempt(self) -> None:
        if self.running:
            self._preempt(self.draw(st.sampled_from(self.running), "victim"))

    def fork(self) -> None:
        """A child sharing a running request's blocks (n > 1 or a beam): between steps."""
        if not self.running or len(self.running) >= self.max_seqs:
            return
        parent = self.draw(st.sampled_from(self.running), "parent")
        if not parent.num_output_tokens:
            return
        child = Request(f"r{next(self.ids)}", parent.prompt_token_ids, cache_salt=parent.cache_salt)
        for token in parent.output_token_ids:
            child.append_token(token)
        if self.draw(st.booleans(), "diverge"):  # another sample in place of the uncomputed last token
            child.token_ids[-1] = self.draw(st.integers(1, 3), "other")
        assert self.manager.fork(parent, child)
        child.block_hashes = parent.block_hashes[:parent.num_computed_tokens // self.block_size]
        child.num_computed_tokens = parent.num_computed_tokens
        self.running.insert(self.running.index(parent) + 1, child)

    def _preempt(self, request: Request) -> None:
        self.manager.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        self.running.remove(request)
        self.waiting.appendleft(request)

    def _drop(self, request: Request) -> None:
        self.manager.free(request)
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        assert not self.manager.block_ids(request)

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> None:
        scheduled: list[ScheduledRequest] = []
        for request in list(self.running):
            if request not in self.running:  # preempted by an earlier one this step
                continue
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > self.chunk:
                num_new = self.chunk
            else:
                room = self.max_model_len - request.num_tokens - 1  # proposals, then one more token
                k = self.draw(st.integers(0, max(0, min(self.max_k, room))), "k")
                request.spec_token_ids = self.draw(st.lists(st.integers(1, 3), min_size=k, max_size=k),
                                                   "proposal")
                num_new += k
            if self._allocate(request, num_new):
                scheduled.append(self._scheduled(request))
        while self.waiting and len(self.running) < self.max_seqs:
            request = self.waiting[0]
            hit = self.manager.find_cached_prefix(request)
            num_new = min(request.num_tokens - hit.num_tokens, self.chunk)
            if not self.manager.allocate_slots(request, num_new, hit):
                break
            self.waiting.popleft()
            request.num_computed_tokens = hit.num_tokens
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new))
        output = SchedulerOutput(scheduled, self.manager.take_block_copies(), [], [],
                                 sum(s.num_new_tokens for s in scheduled))
        self._check_writes(output)
        self.runner.execute(output)
        for item in scheduled:
            self._update(item)
        self._check()

    def _allocate(self, request: Request, num_new: int) -> bool:
        """Blocks for the step; short of them, the proposals go first, then the newest requests."""
        while not self.manager.allocate_slots(request, num_new):
            if request.spec_token_ids:
                num_new -= len(request.spec_token_ids)
                request.spec_token_ids = []
                continue
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _scheduled(self, request: Request, num_new: int | None = None) -> ScheduledRequest:
        if num_new is None:
            num_new = min(request.num_tokens - request.num_computed_tokens, self.chunk) \
                if not request.spec_token_ids else \
                request.num_tokens - request.num_computed_tokens + len(request.spec_token_ids)
        return ScheduledRequest(request, num_new, request.num_computed_tokens,
                                self.manager.block_ids(request), self.block_size)

    def _update(self, item: ScheduledRequest) -> None:
        request = item.request
        proposal = request.spec_token_ids
        end = item.num_context_tokens
        if end - len(proposal) < request.num_tokens:  # a prompt chunk short of the end
            request.num_computed_tokens = end
            return
        accepted = self.draw(st.integers(0, len(proposal)), "accepted")
        # After a rejection the token drawn is never the rejected one (the residual excludes it).
        choices = [t for t in (0, 1, 2, 3) if accepted == len(proposal) or t != proposal[accepted]]
        new = [*proposal[:accepted], self.draw(st.sampled_from(choices), "next")]
        request.spec_token_ids = []
        request.num_computed_tokens = end - (len(proposal) - accepted)
        for token in new:
            request.append_token(token)
        self.manager.trim(request, request.num_computed_tokens)
        if EOS in new or request.num_tokens >= self.max_model_len:
            self._drop(request)

    # -- checks --------------------------------------------------------------------------------
    def _check_writes(self, output: SchedulerOutput) -> None:
        written: set[int] = set()
        for item in output.scheduled:
            slots = new_token_slots(item)
            assert written.isdisjoint(slots), "two requests write the same slot"
            written.update(slots)
            for block_id in {slot // self.block_size for slot in slots}:
                block = self.manager.pool.blocks[block_id]
                assert block.ref_cnt == 1 and not block.is_cached, f"write into shared {block}"

    def _check(self) -> None:
        check_manager(self.manager)
        bs = self.block_size
        for request in self.running:
            ids = self.manager.block_ids(request)
            # Nothing held past the computed tokens (the rejected ones' blocks went back).
            assert len(ids) == cdiv(request.num_computed_tokens, bs), (request, ids)
            assert request.num_computed_tokens == request.num_tokens - 1 or \
                request.num_computed_tokens < request.num_tokens
        for request in self.waiting:
            assert not self.manager.block_ids(request) and not request.num_computed_tokens
        # A cached block's K/V is exactly its registered tokens, one continuing the other.
        for block in self.manager.pool.blocks:
            if block.is_cached:
                contents = self.runner.slots[block.block_id * bs:(block.block_id + 1) * bs]
                for offset, (content, token) in enumerate(zip(contents, block.cache_tokens)):
                    assert content is not None and content[1][-1] == token, (block, contents)
                    if offset:
                        assert content[1][:-1] == contents[offset - 1][1], (block, contents)

    def drain(self) -> None:
        for _ in range(2000):
            if not self.running and not self.waiting:
                break
            self.step()
        assert not self.running and not self.waiting, "starved"
        stats = self.manager.stats()
        assert stats.num_free_blocks == stats.num_blocks and stats.used_slots == 0


@pytest.mark.parametrize("prefix", [False, True], ids=["plain", "prefix"])
@pytest.mark.parametrize("window", [False, True], ids=["full", "window"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_speculative_streams_keep_invariants(prefix, window, data):
    harness = SpecHarness(data, prefix, window)
    actions = [harness.add, harness.add, harness.step, harness.step, harness.step, harness.step,
               harness.abort, harness.preempt, harness.fork]
    for _ in range(data.draw(st.integers(1, 50), "num_ops")):
        data.draw(st.sampled_from(actions), "op")()
    harness.drain()
