"""Continuous batching: which requests run this step, and for how many tokens.

Every step spends a token budget (max_num_batched_tokens) over at most max_num_seqs
requests: running requests first, in admission order (a decode token or the next chunk of
a prompt), then waiting requests, first come first served, while blocks and budget last.
A request is only "tokens known" and "tokens computed", so chunked prefill, prefix-cache
hits and recompute after preemption need no code paths of their own.

Waiting requests are admitted least-served first and preemption takes from the largest group
(pagedllm.core.shares says the rule), so one user request of thousands of sequences cannot hold
the queue; with one sequence per request this is first come first served, as described here.
While G request groups have work, each runs at most ceil(max_num_seqs / G) sequences in a step
(its others rest that step, taking turns; shares.row_share), so one request of hundreds of
sequences cannot make every step, another client's included, as long as it alone would; and
such a group takes at most the others' tokens plus a share measured by pagedllm.core.step_cost
(shares.token_share), so another client's step grows by about half at most.

When a running request cannot get blocks, the most recently admitted running request is
preempted (recompute: its blocks are freed and it goes back to the front of the waiting
queue with every token it has, to be prefilled again). The oldest running request thus
always makes progress, and add_request refuses anything that could not run alone in an
empty cache, so every request finishes.

Under --scheduling-policy priority (pagedllm.core.priority) every rule above holds within a
priority, and a better priority comes first: both queues are in (priority, arrival) order,
preemption for blocks takes the worst priority first, and a waiting request that lacks blocks, a
seat or step tokens preempts running requests of a worse priority in the same step, so it runs in
the step it is admitted. fcfs is the same code with every priority 0.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from pagedllm.config import SchedulerConfig
from pagedllm.core import priority, shares
from pagedllm.core.kv.manager import NO_HIT, PrefixHit
from pagedllm.core.kv.stats import KVStats
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.step_cost import StepCost
from pagedllm.sampling_bounds import check_runnable

logger = logging.getLogger(__name__)


class KVManager(Protocol):
    """What the scheduler needs from KVCacheManager or ContiguousKVManager."""

    block_size: int

    # New tokens one request may take in a step (None: no limit of the cache's).
    max_step_tokens: int | None
    # The longest request that runs alone in the empty cache, in steps of at most max_chunk_tokens.
    def max_tokens_per_request(self, max_chunk_tokens: int) -> int: ...
    def find_cached_prefix(self, request: Request) -> PrefixHit: ...
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       prefix_hit: PrefixHit | None = None) -> bool: ...  # sets no request state
    def free(self, request: Request) -> None: ...
    # Rejected proposal slots given back; the blocks the list keeps where it was cut, else None.
    def trim(self, request: Request, num_kept_tokens: int) -> int | None: ...
    def fork(self, parent: Request, child: Request) -> bool: ...  # False: no room to copy into
    def block_ids(self, request: Request) -> list[int]: ...
    def state_pages(self, request: Request) -> list[int]: ...
    def take_block_copies(self) -> list[tuple[int, int]]: ...
    def stats(self) -> KVStats: ...


@dataclass(eq=False)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    num_computed_tokens: int  # before this step: the position of the first new token
    # The request's whole block table: the manager's live list, valid for this step.
    block_ids: list[int]
    block_size: int
    # A hybrid model's: the pages of the request's recurrent state (KVCacheManager.state_pages).
    state_pages: list[int] = field(default_factory=list)
    # Fixed when scheduled, because update_from_output appends the sampled token.
    samples: bool = field(init=False)
    # Proposed tokens (request.spec_token_ids' first ones) this step runs after the known ones:
    # their positions' logits verify them (pagedllm.spec_decode).
    num_spec_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        # True when this step reaches the end of the known tokens, so a token gets sampled.
        end = self.num_computed_tokens + self.num_new_tokens
        self.samples = end >= self.request.num_tokens
        self.num_spec_tokens = max(0, end - self.request.num_tokens)

    def input_token_ids(self) -> list[int]:
        """The ids this step feeds the model: known tokens, then the proposed ones it verifies."""
        request, start = self.request, self.num_computed_tokens
        known = request.token_ids[start:start + self.num_new_tokens]
        return known + request.spec_token_ids[:self.num_spec_tokens] if self.num_spec_tokens else known

    @property
    def num_context_tokens(self) -> int:
        """Tokens in context after this step (the attention seq_len)."""
        return self.num_computed_tokens + self.num_new_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # in running order
    block_copies: list[tuple[int, int]]  # (src, dst) copies to do, in order, before the model
    preempted: list[Request]
    finished: list[Request]  # finished or aborted since the previous schedule()
    num_batched_tokens: int
    # Block lists cut since the previous schedule() (a speculative step's rejected slots given
    # back), by request id: the blocks each kept. A copy of a block list that only appends what is
    # new (worker/block_table.py) rewrites from there: the list may have grown again since, with
    # other blocks where the cut ones were (another request may have taken them).
    trimmed: dict[str, int] = field(default_factory=dict)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVManager) -> None:
        self.config = config
        self.kv_manager = kv_manager
        self.waiting = priority.WaitingQueue()  # (priority, arrival) order
        self.running: list[Request] = []  # (priority, admission) order; the newest last in its priority
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._finished_since_schedule: list[Request] = []
        self._trimmed_since_schedule: dict[str, int] = {}
        self._num_preemptions = 0
        self._step = 0  # schedule() calls so far: when each request last ran (shares.resting)
        # A group left waiting with none running last step for want of blocks or a seat
        # (pagedllm.core.shares): the next step preempts one sequence of the largest group for it.
        self._starved: str | None = None
        # The engine feeds it each step's tokens and time (EngineCore); it sizes the token share.
        self.step_cost = StepCost(config.max_num_batched_tokens, config.step_share_tokens)
        self._token_share: dict[str, int] = {}  # this step's tokens left per capped group

    # -- queues ------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_preemptions(self) -> int:
        return self._num_preemptions

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def add_request(self, request: Request) -> None:
        self.check_admissible(request)
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self.waiting.add(request)

    def check_admissible(self, request: Request) -> None:
        """What only the scheduler knows: its request ids and the cache's capacity. Prompts
        reach it checked (pagedllm.engine.input_processor); one outside [1, max_model_len] tokens is a
        caller's bug, refused before it can break a step."""
        max_model_len = self.config.max_model_len
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not 0 < request.num_prompt_tokens <= max_model_len:
            raise ValueError(f"request {request.request_id!r} has {request.num_prompt_tokens} prompt "
                             f"tokens; the scheduler takes 1 to max_model_len={max_model_len}")
        # Validated means runnable: a request decoded from another process skipped SamplingParams'
        # checks, and a value no step can run would fail every request in its step.
        try:
            check_runnable(request.sampling_params)
            priority.check_priority(self.config.scheduling_policy, request.priority)
        except ValueError as exc:
            raise ValueError(f"request {request.request_id!r}: {exc}") from None
        # Anything that could not run alone in an empty cache would wait (or preempt) forever.
        max_tokens = request.sampling_params.max_tokens or max_model_len
        needed = min(request.num_prompt_tokens + max_tokens, max_model_len)
        capacity = self.kv_manager.max_tokens_per_request(self.config.max_num_batched_tokens)
        if needed > capacity:
            raise ValueError(f"the request needs up to {needed} tokens of KV cache (prompt "
                             f"{request.num_prompt_tokens} + max_tokens {max_tokens}, capped at "
                             f"{max_model_len}), but the whole cache holds {capacity}")

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        self._step += 1
        # The token share from the demand as the step found it: a sequence the row share preempts
        # just below waits for a seat, so its recomputation must not widen another group's share.
        self._token_share = shares.token_share(self.running, self.waiting, self.step_cost.share_tokens(),
                                               budget)
        self._preempt_for_share(preempted)
        num_share_preempted = len(preempted)
        # Each request group's share of the step's sequence slots (pagedllm.core.shares' rule).
        row_share = shares.row_share(self.running, self.waiting, self.config.max_num_seqs)
        budget = self._schedule_running(budget, scheduled, preempted, row_share)
        # A step short of blocks has none to give, but to a request that outranks a running one.
        budget = self._schedule_waiting(budget, scheduled, preempted, row_share,
                                        outranking_only=len(preempted) > num_share_preempted)
        finished, self._finished_since_schedule = self._finished_since_schedule, []
        trimmed, self._trimmed_since_schedule = self._trimmed_since_schedule, {}
        return SchedulerOutput(
            scheduled=scheduled, block_copies=self.kv_manager.take_block_copies(),
            preempted=preempted, finished=finished,
            num_batched_tokens=self.config.max_num_batched_tokens - budget, trimmed=trimmed)

    def _schedule_running(self, budget: int, scheduled: list[ScheduledRequest],
                          preempted: list[Request], row_share: int | None) -> int:
        i = 0
        counts = shares.running_counts(self.running)
        resting = shares.resting(self.running, counts, row_share)  # past their group's share
        while i < len(self.running) and budget > 0 and len(scheduled) < self.config.max_num_seqs:
            request = self.running[i]
            limit = self._share_limit(request, self._step_limit(budget))
            num_new = 0 if id(request) in resting else self._fit_proposal(request, limit)
            if num_new <= 0:  # not its turn (a proposal is made again when it is), or nothing to compute
                request.spec_token_ids.clear()
                i += 1
                continue
            num_new = self._allocate_or_preempt(request, num_new, preempted, i, counts)
            if not num_new:
                break  # it preempted itself: it was the last running request
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            i += 1
        return budget

    @staticmethod
    def _fit_proposal(request: Request, limit: int) -> int:
        """The request's new tokens this step, within limit: its known tokens not yet computed,
        then its proposed ones (speculative decoding), whose tail goes where the limit cuts."""
        num_known = request.num_tokens - request.num_computed_tokens
        if request.spec_token_ids:
            del request.spec_token_ids[max(0, limit - num_known):]
        return min(num_known + len(request.spec_token_ids), limit)

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: list[Request],
                             index: int, counts) -> int:
        """Blocks for request (self.running[index]), preempting running requests not yet
        scheduled this step until they fit: of the worst priority, the newest of the largest group
        (shares.pick_victim). A proposal is dropped before anyone is preempted (speculation is
        optional, a preemption is not free). The new tokens it got blocks for; 0 if request itself
        had to go."""
        while not self.kv_manager.allocate_slots(request, num_new):
            if request.spec_token_ids:
                num_new -= len(request.spec_token_ids)
                request.spec_token_ids.clear()
                continue
            victim = shares.pick_victim(priority.worst(self.running[index:]), counts)
            self.running.remove(victim)
            counts[shares.share_key(victim.request_id)] -= 1
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return 0
        return num_new

    def _preempt_for_share(self, preempted: list[Request]) -> None:
        """One sequence of the largest group preempted for a group that last step waited with
        none running and could not be admitted (pagedllm.core.shares' rule)."""
        starved, self._starved = self._starved, None
        if starved is None:
            return
        waiting = next((r for r in self.waiting if shares.share_key(r.request_id) == starved), None)
        if waiting is None:
            return
        # Only from the worst priority running, and never a better one than the starved group's.
        candidates = priority.worst(self.running) if self.running else []
        if candidates and candidates[0].priority < waiting.priority:
            candidates = []
        victim = shares.share_victim(candidates, shares.running_counts(candidates), starved)
        if victim is not None:
            self.running.remove(victim)
            self._preempt(victim)
            preempted.append(victim)

    def _preempt(self, request: Request) -> None:
        self.kv_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids.clear()
        request.num_preemptions += 1
        self._num_preemptions += 1
        # Victims come newest first, so the oldest ends up at the front of its priority.
        self.waiting.add_front(request)
        logger.debug("preempted %s (%d tokens to recompute)", request.request_id,
                     request.num_tokens)

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledRequest],
                          preempted: list[Request], row_share: int | None, outranking_only: bool) -> int:
        """Admit waiting requests, best priority first and least-served first within it, while
        seats, budget and blocks last and their group is within its row_share; one that lacks
        them preempts running requests it outranks (pagedllm.core.priority). outranking_only:
        admit only such requests (the step preempted)."""
        counts = shares.running_counts(self.running)
        admitted: set[int] = set()
        spent: set[int] = set()  # waiting sequences of groups whose token share this step is spent
        while len(admitted) + len(spent) < len(self.waiting):
            request = shares.least_served(self.waiting, counts, admitted | spent)
            key = shares.share_key(request.request_id)
            if outranking_only and not priority.outranked_by(request, self.running):
                break
            if row_share is not None and counts[key] >= row_share:
                break  # the least served group has its share: so has every other
            if self._token_share.get(key, 1) <= 0:  # its group's tokens are spent: others may go
                spent.update(id(r) for r in self.waiting if shares.share_key(r.request_id) == key)
                continue
            num_preempted = len(preempted)
            budget = self._take_seat(request, budget, scheduled, preempted, counts)
            if budget <= 0 or len(scheduled) >= self.config.max_num_seqs:
                break
            if len(self.running) >= self.config.max_num_seqs:
                self._starve(key, counts)
                break
            allocated = self._allocate_first(request, budget, scheduled, preempted, counts)
            if allocated is None:
                self._starve(key, counts)
                break  # no one overtakes the request whose turn it is
            hit, num_new, budget = allocated
            admitted.add(id(request))
            counts[key] += 1
            request.num_computed_tokens = hit.num_tokens
            if request.num_cached_tokens < 0:  # its first admission, not a resume
                request.num_cached_tokens = hit.num_tokens
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            priority.insert_running(self.running, request)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            # What was preempted for this one is not for the next to take back.
            outranking_only = outranking_only or len(preempted) > num_preempted
        if admitted:
            self.waiting.remove_all(admitted)
        return budget

    def _take_seat(self, request: Request, budget: int, scheduled: list[ScheduledRequest],
                   preempted: list[Request], counts) -> int:
        """The budget left once request has a seat and step tokens, preempting running requests
        it outranks while it lacks them (none under fcfs)."""
        while budget <= 0 or len(self.running) >= self.config.max_num_seqs:
            freed = self._preempt_outranked(request, scheduled, preempted, counts)
            if freed is None:
                break
            budget += freed
        return budget

    def _allocate_first(self, request: Request, budget: int, scheduled: list[ScheduledRequest],
                        preempted: list[Request], counts) -> tuple[PrefixHit, int, int] | None:
        """Blocks for a waiting request's first chunk, preempting running requests it outranks
        until they fit: (its prefix hit, its new tokens, the budget), or None if they never do."""
        while True:
            # Prompt logprobs need every prompt position run: no cache read (its blocks are
            # still written, and hashed, for others to hit).
            hit = (NO_HIT if request.sampling_params.prompt_logprobs is not None
                   else self.kv_manager.find_cached_prefix(request))
            num_new = min(request.num_tokens - hit.num_tokens,
                          self._share_limit(request, self._step_limit(budget)))
            if self.kv_manager.allocate_slots(request, num_new, hit):
                return hit, num_new, budget
            freed = self._preempt_outranked(request, scheduled, preempted, counts)
            if freed is None:
                return None
            budget += freed

    def _preempt_outranked(self, request: Request, scheduled: list[ScheduledRequest],
                           preempted: list[Request], counts) -> int | None:
        """Preempt one running request that `request` outranks (the newest of the largest group
        of the worst priority), scheduled this step or not: the step tokens it gave back, or
        None when there is none."""
        candidates = priority.outranked_by(request, self.running)
        if not candidates:
            return None
        victim = shares.pick_victim(candidates, counts)
        self.running.remove(victim)
        counts[shares.share_key(victim.request_id)] -= 1
        item = next((s for s in scheduled if s.request is victim), None)
        if item is not None:
            scheduled.remove(item)
            self._take_share(victim, -item.num_new_tokens)
        self._preempt(victim)
        preempted.append(victim)
        return 0 if item is None else item.num_new_tokens

    def _starve(self, key: str, counts) -> None:
        """Note a group that could not be admitted with none of its sequences running."""
        if counts[key] == 0:
            self._starved = key

    def _step_limit(self, budget: int) -> int:
        """New tokens one request may take this step: the budget left, and on a windowed cache
        what keeps it within the whole cache (its window plus this step's tokens)."""
        cap = getattr(self.kv_manager, "max_step_tokens", None)
        return budget if cap is None else min(budget, cap)

    def _share_limit(self, request: Request, limit: int) -> int:
        """limit, within what request's group has left of this step's token share."""
        left = self._token_share.get(shares.share_key(request.request_id))
        return limit if left is None else min(limit, left)

    def _take_share(self, request: Request, num_tokens: int) -> None:
        """num_tokens of request's group's token share taken (given back when negative)."""
        key = shares.share_key(request.request_id)
        if key in self._token_share:
            self._token_share[key] -= num_tokens

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        request.last_scheduled_step = self._step
        self._take_share(request, num_new)
        return ScheduledRequest(request, num_new, request.num_computed_tokens,
                                self.kv_manager.block_ids(request), self.kv_manager.block_size,
                                self.kv_manager.state_pages(request))

    # -- after the model ran --------------------------------------------------------------------

    def update_from_output(self, output: SchedulerOutput,
                           sampled_token_ids: Mapping[str, int | list[int]]) -> list[Request]:
        """Each request that reached the end of its tokens takes its new tokens: one sampled
        token, or for a speculating request its accepted proposal tokens then the one after them
        (only those accepted count as computed; the slots of the rejected go back). A stop ends
        it at that token, the ones after are dropped."""
        finished: list[Request] = []
        for item in output.scheduled:
            request = item.request
            if request.is_finished or request.status is not RequestStatus.RUNNING:
                continue  # aborted (or preempted) since it was scheduled
            request.num_computed_tokens = item.num_context_tokens - item.num_spec_tokens
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prompt chunk short of the end: nothing sampled yet
            tokens = sampled_token_ids.get(request.request_id)
            if tokens is None:
                raise ValueError(f"no sampled token for {request.request_id}, whose step "
                                 "reached the end of its tokens")
            status = self._append(request, [tokens] if isinstance(tokens, int) else tokens,
                                  item.num_spec_tokens)
            if status is not None:
                self._finish(request, status)
                finished.append(request)
            elif item.num_spec_tokens:
                kept = self.kv_manager.trim(request, request.num_computed_tokens)
                if kept is not None:
                    self._trimmed_since_schedule[request.request_id] = min(
                        kept, self._trimmed_since_schedule.get(request.request_id, kept))
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
        return finished

    def _append(self, request: Request, tokens: list[int], num_spec: int) -> RequestStatus | None:
        """Append tokens (at most num_spec + 1) one by one, each stop-checked; the status of the
        one that stops the request, if one does. All but the last appended have computed K/V (a
        request that stops inside its run counts them too: its blocks full of them are cached
        when it is freed)."""
        if not 1 <= len(tokens) <= num_spec + 1:
            raise ValueError(f"{len(tokens)} new tokens for {request.request_id}, which ran "
                             f"{num_spec} proposed ones")
        request.spec_token_ids.clear()
        for appended, token in enumerate(tokens, 1):
            request.append_token(token)
            status = self.stop_status(request, token)
            if status is not None:
                request.num_computed_tokens += appended - 1
                return status
        request.num_computed_tokens += len(tokens) - 1
        return None

    def stop_status(self, request: Request, token: int) -> RequestStatus | None:
        """The finished status a request reaches by having just appended `token`, if any
        (a stop token id also becomes request.stop_reason)."""
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished and give its blocks back; the caller takes it out of its queue."""
        request.status = status
        self.kv_manager.free(request)
        del self._requests[request.request_id]
        self._finished_since_schedule.append(request)

    # -- from outside ------------------------------------------------------------------------

    def finish_requests(self, request_ids: str | Iterable[str],
                        status: RequestStatus) -> list[Request]:
        """Finish requests in any state (stop strings, aborts); unknown ids are skipped."""
        if not status.finished:
            raise ValueError(f"status must be a finished status; got {status}")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        finished = [self._requests[rid] for rid in dict.fromkeys(request_ids)
                    if rid in self._requests]
        for request in finished:
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
        return finished

    def abort_request(self, request_id: str) -> Request | None:
        finished = self.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        return finished[0] if finished else None

    def fork_request(self, parent: Request, child: Request) -> None:
        """The child (same tokens as the parent up to its computed ones) shares the parent's
        blocks and runs right after it. Call between update_from_output and schedule."""
        if parent.status is not RequestStatus.RUNNING:
            raise ValueError(f"can only fork a running request; {parent.request_id} is "
                             f"{parent.status.value}")
        self.check_admissible(child)
        computed = parent.num_computed_tokens
        shares_prefix = child.token_ids[:computed] == parent.token_ids[:computed]
        if child.num_tokens <= computed or not shares_prefix:
            raise ValueError("a forked child must start with the parent's computed tokens "
                             "and have at least one more")
        self._requests[child.request_id] = child
        if not child.block_hashes:  # the shared computed blocks hash alike
            child.block_hashes = parent.block_hashes[:computed // self.kv_manager.block_size]
        child.num_cached_tokens = parent.num_cached_tokens
        if self.kv_manager.fork(parent, child):
            child.num_computed_tokens = computed
            child.status = RequestStatus.RUNNING
            self.running.insert(self.running.index(parent) + 1, child)
        else:  # no room to copy into (contiguous layout): recompute it when room frees up
            child.num_computed_tokens = 0
            child.status = RequestStatus.WAITING
            self.waiting.add_front(child)
