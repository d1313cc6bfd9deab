"""TEST-ONLY hooks that run inside the engine core process (PAGEDLLM_CORE_TEST_HOOKS names this
module; RunningServer.debug(name, **args) calls one between two of the core's steps).

They wrap the core's model step (runner.execute) to fail, slow down or stall it, the way the
in-process tests used to monkeypatch it: the step still runs in the core, so a fault takes the
same path through the core, the channel and the server as a real one would.
"""

from __future__ import annotations

import time
from pathlib import Path

POISON = "POISON"  # a prompt starting with this fails every step it is scheduled in


class InjectedFault(RuntimeError):
    pass


_state: dict = {"failed": 0, "steps": 0}


def _wrap(core, before) -> None:
    """Run before(scheduled) ahead of every model step (it may raise or wait)."""
    restore(core)
    real_execute = core.runner.execute
    _state.update(failed=0, steps=0, real_execute=real_execute)

    def execute(scheduled, argmax_only=False):
        _state["steps"] += 1
        before(scheduled)
        return real_execute(scheduled, argmax_only)

    core.runner.execute = execute


def restore(core) -> dict:
    """Back to the real step; how many steps the last hook failed."""
    real_execute = _state.pop("real_execute", None)
    if real_execute is not None:
        core.runner.execute = real_execute
    return {"failed": _state["failed"], "steps": _state["steps"]}


def _fail() -> None:
    _state["failed"] += 1
    raise InjectedFault("injected fault in the model step")


def fail_steps(core, when: str, poison_ids: list[int] | None = None, nth: int = 0) -> None:
    """Make the model step raise InjectedFault:
    when="poison": a request whose prompt starts with poison_ids is in the batch;
    when="poison_while_another_waits": the same, but only once another request waits behind it
    (until then each such step is slowed down, so that the other can arrive);
    when="nth": on the nth step from now; when="always": every step."""
    def before(scheduled) -> None:
        if when == "always" or (when == "nth" and _state["steps"] == nth):
            _fail()
        poisoned = any(s.request.prompt_token_ids[:len(poison_ids or [])] == poison_ids for s in scheduled)
        if when == "poison" and poisoned:
            _fail()
        if when == "poison_while_another_waits" and poisoned:
            if core.scheduler.num_waiting:
                _fail()
            time.sleep(0.02)

    _wrap(core, before)


def slow_steps(core, seconds: float) -> None:
    """Each model step takes at least this long more."""
    _wrap(core, lambda scheduled: time.sleep(seconds))


def stall_steps(core, stalled_path: str, release_path: str) -> None:
    """Hold the next model step until release_path exists (60 s at most), after creating
    stalled_path to say it is holding."""
    def before(scheduled) -> None:
        Path(stalled_path).touch()
        deadline = time.monotonic() + 60
        while not Path(release_path).exists() and time.monotonic() < deadline:
            time.sleep(0.005)

    _wrap(core, before)
