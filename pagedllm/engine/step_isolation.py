"""When a step fails, find the requests that made it fail, so that only they fail.

Each request in the failed step (with its forks: a request group) runs the model alone, forward
only: no sampling, so no sampler state moves, and a model run writes only its own tokens' K/V
slots, which the re-run writes again. The groups whose lone run fails are the culprits; the step
then runs again without them, and everyone else's tokens are what they would have been.

Where every lone run succeeds (the fault lies in no single request: memory, a bad kernel, the
sampler) or every one fails, nothing can be pinned: the caller fails the whole step as before.
So does a hybrid model's step: its run advances each request's recurrent state in place (the
failed attempt may have, after the model ran), so a second run of the same tokens would apply
them twice.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from functools import partial

from pagedllm.core.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


class StepError(RuntimeError):
    """A step failed. The requests it ran are finished (aborted, their blocks freed) already;
    request_ids names them. The cause is chained (raise ... from)."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"the engine step failed: {cause!r}")
        self.request_ids = request_ids


class StepIsolation:
    """EngineCore's failure path (the core's own requests, executor and step: self is the core)."""

    def _run_without_culprits(self, out: SchedulerOutput, run: Callable[[SchedulerOutput], list],
                              exc: Exception):
        """(outputs, culprits, error) of the step run again by run (the core's step as it was
        tried: plain or a decode burst) without the requests that fail the model alone (they end
        here; the caller reports them); StepError, the step's requests ended, where none can be
        pinned or the second run fails too."""
        seqs = self.requests.seqs
        if getattr(self.executor.runner, "recurrent", False):  # a re-run would advance states twice
            raise StepError(self._fail(out), exc) from exc
        culprits = find_culprits(partial(self.executor.execute, argmax_only=True), out,
                                 lambda request_id: seqs[request_id].group.request_id)
        if not culprits:
            raise StepError(self._fail(out), exc) from exc
        self.abort_requests(culprits)
        rest = without(out, {s.request.request_id for s in out.scheduled if s.request.is_finished})
        try:
            return run(rest), culprits, repr(exc)
        except Exception as again:
            raise StepError(self._fail(rest) + culprits, again) from again

    def _fail(self, out: SchedulerOutput) -> list[str]:
        """Abort every request the failed step ran; their ids."""
        seqs = self.requests.seqs
        request_ids = list(dict.fromkeys(seqs[s.request.request_id].group.request_id
                                         for s in out.scheduled if s.request.request_id in seqs))
        logger.exception("engine step failed; aborting its %d requests", len(request_ids))
        self.abort_requests(request_ids)
        return request_ids


def find_culprits(execute: Callable[[SchedulerOutput], object], out: SchedulerOutput,
                  group_of: Callable[[str], str]) -> list[str]:
    """The request groups (ids) whose scheduled sequences fail the model when run alone; [] where
    none or all do."""
    groups: dict[str, list] = {}
    for item in out.scheduled:
        groups.setdefault(group_of(item.request.request_id), []).append(item)
    if len(groups) < 2:
        return []
    culprits = []
    for group_id, items in groups.items():
        try:
            execute(only(out, items))
        except Exception as exc:  # noqa: BLE001 - any failure of a lone run marks its request
            logger.error("request %s fails the model step on its own: %r", group_id, exc)
            culprits.append(group_id)
    return culprits if len(culprits) < len(groups) else []


def only(out: SchedulerOutput, items: list) -> SchedulerOutput:
    """out restricted to items (nothing to drop or copy: the failed attempt did that)."""
    return dataclasses.replace(out, scheduled=items, block_copies=[], preempted=[], finished=[],
                               num_batched_tokens=sum(i.num_new_tokens for i in items))


def without(out: SchedulerOutput, request_ids: set[str]) -> SchedulerOutput:
    """out with the sequences of request_ids left out (their copies still done: harmless)."""
    kept = [item for item in out.scheduled if item.request.request_id not in request_ids]
    return dataclasses.replace(out, scheduled=kept, preempted=[], finished=[],
                               num_batched_tokens=sum(i.num_new_tokens for i in kept))
