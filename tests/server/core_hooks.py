"""Test hooks that run inside the engine core process: an extension of the core
(pagedllm/engine/core_process.py, `--extension tests.server.core_hooks`, which RunningServer
passes when it starts the core; HookClient, below, calls them from the test process).

They wrap the core's model step (executor.execute, and execute_burst: a decode burst's) to fail,
slow down or stall it, the way the in-process tests used to monkeypatch it: the step still runs in
the core, so a fault takes the same path through the core, the channel and the server as a real
one would.

A call goes as a HookCall through the API process's own channel to the core (so it is applied
between two steps, in order with the requests sent before and after it); the answer comes back
on a socket of the test's own (HookCall.reply_to), so nothing of this crosses the package's
channel the other way, and a core started without this extension drops the calls as unknown
messages.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

POISON = "POISON"  # a prompt starting with this fails every step it is scheduled in
EXTENSION = __name__  # what RunningServer passes to the core as --extension


class HookCall(msgspec.Struct, tag="test_hook"):
    """Call hook `name` with (core, **args) between two steps; answer on reply_to."""

    name: str
    reply_to: str
    args: dict[str, Any] = {}


class HookReply(msgspec.Struct):
    result: Any = None
    error: str | None = None


class InjectedFault(RuntimeError):
    pass


# -- the core's side ----------------------------------------------------------------------------

_state: dict = {"failed": 0, "steps": 0}
_replies: dict[str, zmq.Socket] = {}  # reply_to -> a PUSH socket connected to it


def extend(loop) -> None:
    """Called by the core process once the core is loaded: handle HookCalls."""
    def handle(call: HookCall) -> None:
        try:
            reply = HookReply(result=HOOKS[call.name](loop.core, **call.args))
        except Exception as exc:
            reply = HookReply(error=repr(exc))
        if call.reply_to not in _replies:
            socket = zmq.Context.instance().socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(call.reply_to)
            _replies[call.reply_to] = socket
        _replies[call.reply_to].send(msgspec.msgpack.encode(reply))

    loop.register(HookCall, handle)


def _wrap(core, before) -> None:
    """Run before(scheduled) ahead of every model step (it may raise or wait)."""
    restore(core)
    real_execute, real_burst = core.executor.execute, core.executor.execute_burst
    _state.update(failed=0, steps=0, real_execute=real_execute, real_burst=real_burst)

    def execute(out, argmax_only=False, prompt_logprobs=None):
        if out.scheduled:
            _state["steps"] += 1
            before(out.scheduled)
        return real_execute(out, argmax_only, prompt_logprobs)

    def execute_burst(out, *args):  # a decode burst's step (pagedllm.engine.decode_burst)
        if out.scheduled:
            _state["steps"] += 1
            before(out.scheduled)
        return real_burst(out, *args)

    core.executor.execute, core.executor.execute_burst = execute, execute_burst


def restore(core) -> dict:
    """Back to the real step; how many steps the last hook failed."""
    real_execute, real_burst = _state.pop("real_execute", None), _state.pop("real_burst", None)
    if real_execute is not None:
        core.executor.execute, core.executor.execute_burst = real_execute, real_burst
    return {"failed": _state["failed"], "steps": _state["steps"]}


def _fail() -> None:
    _state["failed"] += 1
    raise InjectedFault("injected fault in the model step")


def fail_steps(core, when: str, poison_ids: list[int] | None = None, nth: int = 0,
               delay_s: float = 0.0) -> None:
    """Make the model step raise InjectedFault (each step first waits delay_s, so that
    requests sent one after another share steps):
    when="poison": a request whose prompt starts with poison_ids is in the batch;
    when="poison_while_another_waits": the same, but only once another request waits behind it
    (until then each such step is slowed down, so that the other can arrive);
    when="nth": on the nth step from now; when="always": every step."""
    def before(scheduled) -> None:
        time.sleep(delay_s)
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


HOOKS = {hook.__name__: hook for hook in (restore, fail_steps, slow_steps, stall_steps)}


# -- the test's side ----------------------------------------------------------------------------

class HookClient:
    """Calls hooks in a RunningServer's core and waits for their answers (on a socket of its own,
    in a directory only this user can enter)."""

    def __init__(self) -> None:
        self._directory = tempfile.TemporaryDirectory(prefix="pagedllm-hooks-")
        self.reply_to = f"ipc://{Path(self._directory.name) / 'replies'}"
        self._replies = zmq.Context.instance().socket(zmq.PULL)
        self._replies.setsockopt(zmq.LINGER, 0)
        self._replies.bind(self.reply_to)

    def call(self, send, name: str, timeout_s: float, **args):
        """Send HookCall(name, args) with send (which must put it on the core's channel from the
        thread that owns it) and return the hook's result; RuntimeError if the hook failed,
        AssertionError if no answer came within timeout_s."""
        send(HookCall(name, self.reply_to, args))
        if not self._replies.poll(timeout_s * 1000):
            raise AssertionError(f"the core did not answer test hook {name} within {timeout_s:g} s "
                                 "(was it started with this extension?)")
        reply = msgspec.msgpack.decode(self._replies.recv(), type=HookReply)
        if reply.error is not None:
            raise RuntimeError(f"test hook {name} failed in the core: {reply.error}")
        return reply.result

    def close(self) -> None:
        self._replies.close(linger=0)
        self._directory.cleanup()
