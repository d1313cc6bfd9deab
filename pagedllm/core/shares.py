"""Fair shares: one request (or client) cannot hold the whole queue.

The rule. Sequences are grouped by share key: the user request they belong to (a completion of 64
prompts x n=64 is one group of 4,096 sequences; see share_key). The scheduler then
- admits waiting sequences least-served first: the waiting sequence whose group has the fewest
  running sequences goes next (queue order among equals, so with one sequence per group this is
  first come first served);
- when it must preempt for blocks, takes the newest sequence of the group with the most running
  ones (with one sequence per group: the newest, as before), never one already scheduled this step;
- when a group has sequences waiting and none running while another group runs two or more, and
  the waiting one could not get blocks or a seat, it preempts one sequence of the largest group at
  the start of the next step (one per step), so the newcomer is admitted within a few steps
  instead of after the whole large request.
A group never loses its last running sequence to another, so every group keeps making progress,
and the oldest running sequence is still never preempted while anything newer runs.

A share of each step (issue 32): on a CPU a step's time grows with its rows, so a group of 256
sequences decoding beside one stream made every step, the stream's included, ~36x longer. While G
groups have sequences running or waiting (G >= 2), each group may run at most ceil(max_num_seqs /
G) sequences in a step (row_share): its others rest that step, keeping their blocks, and take the
next turns (those that ran least recently first, so none of them starves); a group at its share
admits no more from the queue. The share is not lent out: the step is shorter rather than filled by
the big group, which is the point. A group alone takes the whole step. Tokens are not capped
beyond the rows: a prefill chunk is already bounded by the step's budget, and splitting the budget
among groups would delay every long prompt's first token behind decodes that need one token each.

A share of each step's tokens: rows are not the step's cost, tokens are, and a step of 128
decode rows still took ~11x a lone stream's on a 2-core CPU. So a group of two or more sequences
may take at most the tokens the other groups have to compute this step (at most the step's
budget) plus free tokens: those whose compute costs what the step's fixed part (its weight reads)
costs, measured as the engine runs (pagedllm.core.step_cost), so such a group at most about
doubles the others' step time. Its other sequences rest that step as above. A group of one
sequence is not token-capped (its prompt chunk is bounded by the budget, as everyone's), nor is
any group alone, nor is anyone while the cost is unmeasured or the share configured off
(EngineConfig.step_share_tokens = 0). Among many groups of one sequence each (the usual server
load) nothing changes: each is one token beside many.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from math import ceil

from pagedllm.core.request import Request


def share_key(request_id: str) -> str:
    """The group a sequence's id belongs to, by the engine's id rules: the n outputs of one prompt
    are "<id>#<i>" (pagedllm.engine.request_group), and the prompts of one server request are
    "<response id>-<i>" (pagedllm.server.api). Other ids are a group of their own."""
    base = request_id.split("#", 1)[0]
    head, sep, tail = base.rpartition("-")
    return head if sep and head and tail.isdigit() else base


def running_counts(running: Iterable[Request]) -> Counter:
    return Counter(share_key(r.request_id) for r in running)


def row_share(running: Iterable[Request], waiting: Iterable[Request], max_num_seqs: int) -> int | None:
    """The sequences one group may run in a step: ceil(max_num_seqs / G) for the G groups with
    sequences running or waiting; None (no cap) with fewer than two."""
    groups = {share_key(r.request_id) for r in running} | {share_key(r.request_id) for r in waiting}
    return ceil(max_num_seqs / len(groups)) if len(groups) >= 2 else None


def token_share(running: Iterable[Request], waiting: Iterable[Request], free_tokens: int | None,
                budget: int) -> dict[str, int]:
    """The tokens each group of two or more sequences may take this step: what the other groups
    have to compute (capped at the budget) plus free_tokens. {} (no cap) with fewer than two
    groups, or free_tokens None (unmeasured) or 0 (off)."""
    if not free_tokens:
        return {}
    demand: Counter = Counter()
    sizes: Counter = Counter()
    for request in (*running, *waiting):
        key = share_key(request.request_id)
        demand[key] += request.num_tokens - request.num_computed_tokens + len(request.spec_token_ids)
        sizes[key] += 1
    if len(demand) < 2:
        return {}
    total = sum(demand.values())
    return {key: min(total - own, budget) + free_tokens for key, own in demand.items() if sizes[key] >= 2}


def resting(running: Sequence[Request], counts: Counter, share: int | None) -> set[int]:
    """The id()s of running sequences past their group's share this step: of a group running more
    than `share`, all but the `share` that ran least recently (admission order among equals)."""
    if share is None or max(counts.values(), default=0) <= share:
        return set()
    by_group: dict[str, list[Request]] = {}
    for request in running:
        if counts[key := share_key(request.request_id)] > share:
            by_group.setdefault(key, []).append(request)
    rest: set[int] = set()
    for group in by_group.values():
        # sorted() is stable: among equal steps, admission order.
        rest.update(id(r) for r in sorted(group, key=lambda r: r.last_scheduled_step)[share:])
    return rest


def least_served(waiting: Sequence[Request], counts: Counter, skip: set[int]) -> Request | None:
    """The waiting sequence to admit next: of the group with the fewest running sequences, its
    first in queue order (ids in skip already taken this step), among those of the best priority
    (the queue's first; pagedllm.core.priority). None when all are taken."""
    best, best_count = None, None
    for request in waiting:
        if id(request) in skip:
            continue
        if best is not None and request.priority != best.priority:
            break  # the queue is in priority order: a worse priority waits for this one's turn
        count = counts[share_key(request.request_id)]
        if best_count is None or count < best_count:
            best, best_count = request, count
            if count == 0:
                break
    return best


def pick_victim(candidates: Sequence[Request], counts: Counter) -> Request:
    """Whom to preempt among candidates (running sequences not yet scheduled this step, in
    admission order): the newest of the group with the most running sequences."""
    top = max(counts[share_key(r.request_id)] for r in candidates)
    return next(r for r in reversed(candidates) if counts[share_key(r.request_id)] == top)


def share_victim(running: Sequence[Request], counts: Counter, starved: str) -> Request | None:
    """A sequence to preempt for group `starved` (waiting, none running): the newest of the
    largest group, if that group runs at least two (None otherwise, or if starved runs one)."""
    if counts[starved] > 0 or not counts:
        return None
    key, top = counts.most_common(1)[0]
    if top < 2:
        return None
    return next(r for r in reversed(running) if share_key(r.request_id) == key)
