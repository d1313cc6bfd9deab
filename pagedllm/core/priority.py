"""Priority scheduling (--scheduling-policy priority, vLLM's spelling): lower value first.

A request's priority is an integer, 0 unless given. The waiting queue is ordered by (priority,
arrival): a new request goes behind every waiting request of its priority or better, a preempted
one back to the front of its priority (it is older than those that never ran). Running requests
are kept in the same order, so a step serves the best priorities first and preemption for blocks
takes the worst priority first. A waiting request that cannot get blocks, a seat or step tokens
preempts running requests of a strictly worse priority (the newest of the worst), in the same step.

fcfs is this with every priority 0: nothing outranks anything, the queue is first come first
served, and a non-zero priority is refused (check_priority) rather than silently ignored.

No aging: a steady stream of better-priority requests keeps a worse one waiting (or preempts it
again) for as long as it lasts; no starvation guarantee is claimed across priorities.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Sequence

from pagedllm.core.request import Request

# A priority crosses the core's channel as a msgpack integer: int64 bounds it.
MIN_PRIORITY, MAX_PRIORITY = -(2**63), 2**63 - 1


def check_priority(policy: str, priority: object) -> None:
    """ValueError (naming the field and the flag) unless `priority` is one `policy` runs."""
    if not isinstance(priority, int) or isinstance(priority, bool) or \
            not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}]; "
                         f"got {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(f"priority {priority} needs --scheduling-policy priority (this engine "
                         f"schedules {policy}: leave priority out or 0)")


def _priority(request: Request) -> int:
    return request.priority


class WaitingQueue:
    """Requests waiting to run, ordered by (priority, arrival). Iteration is in that order."""

    def __init__(self) -> None:
        self._requests: list[Request] = []

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __getitem__(self, index: int) -> Request:
        return self._requests[index]

    def add(self, request: Request) -> None:
        """A new arrival: behind every waiting request of its priority or better."""
        self._requests.insert(bisect_right(self._requests, request.priority, key=_priority), request)

    def add_front(self, request: Request) -> None:
        """A preempted request (or a fork to recompute): first of its priority."""
        self._requests.insert(bisect_left(self._requests, request.priority, key=_priority), request)

    def remove(self, request: Request) -> None:
        self._requests.remove(request)

    def remove_all(self, ids: set[int]) -> None:
        """Take out the requests whose id() is in ids (those admitted this step)."""
        self._requests = [r for r in self._requests if id(r) not in ids]


def insert_running(running: list[Request], request: Request) -> None:
    """Admit into the running list, kept in (priority, admission) order."""
    running.insert(bisect_right(running, request.priority, key=_priority), request)


def worst(candidates: Sequence[Request]) -> list[Request]:
    """The candidates of the worst (largest) priority among them, in their order."""
    lowest = max(r.priority for r in candidates)
    return [r for r in candidates if r.priority == lowest]


def outranked_by(request: Request, running: Iterable[Request]) -> list[Request]:
    """The running requests `request` may preempt: those of the worst priority, if it is strictly
    worse than request's (else none)."""
    running = list(running)
    if not running:
        return []
    candidates = worst(running)
    return candidates if candidates[0].priority > request.priority else []
