"""Random streams of add / step / abort / finish / fork over tiny caches, checking after every
operation that blocks are accounted for, budgets hold, shared blocks are never written and
every request reads back exactly its own K/V; then everything must finish, in order."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv import ContiguousKVManager, KVCacheManager
from pagedllm.core.kv.kinds import kv_page_kind
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils import cdiv
from tests.core.kv.sim import SimRunner, check_output, check_scheduler

EOS = 0
# "+state": a hybrid model's pool, KV pages and each request's recurrent state pages mixed;
# "+latent": MLA's latent pages (with state pages too: every kind of page one pool can hold).
LAYOUTS = ["paged", "paged+prefix", "paged+window", "paged+prefix+window", "contiguous-max",
           "contiguous-request", "paged+state", "paged+window+state", "paged+prefix+latent",
           "paged+latent+state"]


def make_manager(layout: str, num_blocks: int, block_size: int, max_model_len: int,
                 sliding_window: int | None, state_pages: int = 0):
    if layout.startswith("contiguous"):
        return ContiguousKVManager(num_blocks, block_size, max_model_len,
                                   reserve=layout.removeprefix("contiguous-"))
    return KVCacheManager(num_blocks, block_size, enable_prefix_caching="prefix" in layout,
                          sliding_window=sliding_window, state_pages_per_request=state_pages,
                          kv_kind=kv_page_kind(sliding_window, latent="latent" in layout))


class Harness:
    def __init__(self, data, layout: str) -> None:
        self.draw = data.draw
        # Small blocks more often: they make full (cacheable) blocks and tight caches likelier.
        block_size = self.draw(st.sampled_from([1, 2, 2, 4, 4, 4, 8, 16, 32, 64]), "block_size")
        max_model_len = self.draw(st.integers(4, 48), "max_model_len")
        # Tiny caches: from half a max-length request to about two of them.
        per_request = cdiv(max_model_len, block_size)
        num_blocks = self.draw(st.integers(max(1, per_request // 2), 2 * per_request + 1),
                               "num_blocks")
        self.config = SchedulerConfig(
            max_num_seqs=self.draw(st.integers(1, 5), "max_num_seqs"),
            max_num_batched_tokens=self.draw(st.integers(1, 40), "max_num_batched_tokens"),
            max_model_len=max_model_len)
        # Windows from one token (every block but the newest freed) to wider than the longest
        # request (nothing freed).
        window = self.draw(st.integers(1, max_model_len + 2), "window") if "window" in layout else None
        state_pages = self.draw(st.integers(1, 3), "state_pages") if "state" in layout else 0
        self.manager = make_manager(layout, num_blocks + state_pages, block_size, max_model_len, window,
                                    state_pages)
        self.scheduler = Scheduler(self.config, self.manager)
        self.runner = SimRunner(num_blocks + state_pages, block_size, window)
        self.ids = itertools.count()
        self.prompts: list[list[int]] = []
        self.arrival: dict[str, int] = {}  # request id -> add order, for FCFS checks
        self.admitted: list[str] = []  # first admissions, in order

    def add(self) -> None:
        prompt = self._prompt()
        params = SamplingParams(
            max_tokens=self.draw(st.one_of(st.none(), st.integers(1, 12)), "max_tokens"),
            min_tokens=self.draw(st.integers(0, 1), "min_tokens"),
            ignore_eos=self.draw(st.booleans(), "ignore_eos"))
        request = Request(f"r{next(self.ids)}", prompt, params, eos_token_ids=(EOS,),
                          cache_salt=self.draw(st.sampled_from([None, None, "s"]), "salt"))
        capacity = self.manager.max_tokens_per_request(self.config.max_num_batched_tokens)
        needed = min(len(prompt) + (params.max_tokens or self.config.max_model_len),
                     self.config.max_model_len)
        if len(prompt) > self.config.max_model_len or needed > capacity:
            with pytest.raises(ValueError):
                self.scheduler.add_request(request)
            return
        self.scheduler.add_request(request)
        self.arrival[request.request_id] = len(self.arrival)
        self.prompts.append(prompt)

    def _prompt(self) -> list[int]:
        # Mostly extend an earlier prompt so prefixes are shared; tokens from a tiny alphabet.
        base: list[int] = []
        if self.prompts and self.draw(st.integers(0, 3), "extend"):
            earlier = self.draw(st.sampled_from(self.prompts), "earlier")
            base = earlier[:self.draw(st.integers(0, len(earlier)), "cut")]
        max_extra = self.draw(st.sampled_from([3, self.config.max_model_len]), "max_extra")
        extra = self.draw(st.lists(st.integers(1, 3), max_size=max_extra), "tail")
        return (base + extra)[:self.config.max_model_len + 2] or [1]

    def step(self) -> None:
        output = self.scheduler.schedule()
        check_output(self.scheduler, output)
        self.runner.execute(output)
        self.admitted += [item.request.request_id for item in output.scheduled
                          if item.request.request_id not in self.admitted]
        sampled = {item.request.request_id: self.draw(st.integers(0, 3), "token")
                   for item in output.scheduled if item.samples}
        finished = self.scheduler.update_from_output(output, sampled)
        for request in finished:
            assert request.is_finished and not self.manager.block_ids(request)
        check_scheduler(self.scheduler)

    def live_request(self) -> Request | None:
        live = list(self.scheduler._requests.values())
        return self.draw(st.sampled_from(live), "pick") if live else None

    def abort(self) -> None:
        request = self.live_request()
        if request is None or self.draw(st.booleans(), "unknown"):
            assert self.scheduler.abort_request("no-such-id") is None
            return
        assert self.scheduler.abort_request(request.request_id) is request
        assert request.status is RequestStatus.FINISHED_ABORTED
        assert self.scheduler.abort_request(request.request_id) is None

    def finish(self) -> None:
        request = self.live_request()
        if request is not None:
            done = self.scheduler.finish_requests(request.request_id,
                                                  RequestStatus.FINISHED_STOPPED)
            assert done == [request] and not self.manager.block_ids(request)

    def fork(self) -> None:
        candidates = [r for r in self.scheduler.running if r.num_computed_tokens]
        if not candidates:
            return
        parent = self.draw(st.sampled_from(candidates), "parent")
        # Like sampling n > 1: the same prompt, and the same outputs except perhaps the
        # last sampled token.
        child = Request(f"r{next(self.ids)}", parent.prompt_token_ids, parent.sampling_params,
                        eos_token_ids=(EOS,), cache_salt=parent.cache_salt)
        for token in parent.output_token_ids:
            child.append_token(token)
        last_is_new_output = parent.num_output_tokens and \
            parent.num_tokens > parent.num_computed_tokens
        if last_is_new_output and self.draw(st.booleans(), "diverge"):
            child.token_ids[-1] = self.draw(st.integers(1, 3), "other")
        self.scheduler.fork_request(parent, child)
        check_scheduler(self.scheduler)

    def drain(self) -> None:
        # Every request does at most max_model_len tokens of work per admission; a generous
        # bound still catches a livelock.
        for _ in range(5000):
            if not self.scheduler.has_unfinished_requests():
                break
            self.step()
        assert not self.scheduler.has_unfinished_requests(), f"starved: {self._state()}"
        stats = self.manager.stats()
        assert stats.num_free_blocks == stats.num_blocks and stats.used_slots == 0

    def _state(self) -> str:
        def show(r: Request) -> str:
            return f"{r.request_id}({r.num_computed_tokens}/{r.num_tokens} {r.status.value})"
        return (f"running={[show(r) for r in self.scheduler.running]} "
                f"waiting={[show(r) for r in self.scheduler.waiting]} {self.config} "
                f"{self.manager.stats()}")

    def check_fcfs(self) -> None:
        firsts = [self.arrival[rid] for rid in self.admitted if rid in self.arrival]
        assert firsts == sorted(firsts), "a later request was admitted before an earlier one"


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_streams_keep_invariants(layout, data):
    harness = Harness(data, layout)
    actions = [harness.add, harness.add, harness.step, harness.step, harness.step,
               harness.abort, harness.finish, harness.fork]
    num_ops = data.draw(st.integers(1, 60), "num_ops")
    for _ in range(num_ops):
        data.draw(st.sampled_from(actions), "op")()
    harness.drain()
    harness.check_fcfs()
