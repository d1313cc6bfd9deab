"""Runs the engine in one background thread and connects it to asyncio request handlers.

The thread steps while there is work and sleeps on an event when there is none, so an idle
server uses no CPU. Handlers never touch the engine directly: adds and aborts are commands the
thread applies between steps, and outputs come back through per-request asyncio queues.

Faults: a step that raises fails only the requests that step scheduled (their clients get the
error, their blocks go back) and the thread goes on with the rest. Several failed steps in a row
mean the engine itself is broken: it is marked dead, every request fails, /health says 503.
Overload: at most max_waiting_requests requests wait for the engine; past that, new ones are
refused at once (QueueFullError, a 503 with Retry-After) instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pagedllm.engine import LLMEngine
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.server.protocol import DEFAULT_MAX_WAITING_REQUESTS

logger = logging.getLogger(__name__)

MAX_CONSECUTIVE_STEP_FAILURES = 3


class EngineDeadError(RuntimeError):
    pass


class QueueFullError(RuntimeError):
    """Too many requests are waiting already; the client should retry later."""


class RequestFailed(RuntimeError):
    """The engine failed while running this request; the message is safe to show a client."""


@dataclass
class _Add:
    request_id: str
    prompt: dict
    params: SamplingParams
    cache_salt: str | None
    stream: asyncio.Queue
    done: asyncio.Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    done: asyncio.Future


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_finished=None,
                 max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS) -> None:
        self.check_args(max_waiting_requests)
        self.engine = engine
        self.on_finished = on_finished  # called in the event loop with each final RequestOutput
        self.max_waiting_requests = max_waiting_requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Sending a command and closing the engine thread exclude each other, so no add can be
        # queued after the thread's last look at the queue (its caller would wait forever).
        self._lock = threading.Lock()
        self._closed = False
        self._adds_sent = 0  # written only by the event loop
        self._adds_applied = 0  # written only by the engine thread
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.dead_reason: str | None = None
        self.snapshot: dict = self._stats()
        self.num_steps = 0
        self.num_failed_steps = 0
        self.num_failed_requests = 0
        self.num_rejected_requests = 0  # refused because the waiting queue was full
        self.max_batch_requests = 0  # the most requests one step has run: evidence of batching

    @staticmethod
    def check_args(max_waiting_requests: int | None = None) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be at least 1; got {max_waiting_requests}")

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    @property
    def healthy(self) -> bool:
        return (self.dead_reason is None and not self._closed and self._thread is not None
                and self._thread.is_alive())

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: sent but not yet added, plus the scheduler's waiting queue
        (which also holds preempted requests). Read from the event loop; close enough."""
        return self._adds_sent - self._adds_applied + self.engine.scheduler.num_waiting

    def check_room(self, num_requests: int = 1) -> None:
        """QueueFullError if num_requests more would pass max_waiting_requests."""
        limit = self.max_waiting_requests
        if limit is not None and self.num_waiting + num_requests > limit:
            self.num_rejected_requests += 1
            raise QueueFullError(f"the server is overloaded: {self.num_waiting} requests are "
                                 f"waiting (the limit is {limit}); retry later")

    # -- requests ------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: dict, params: SamplingParams,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Add a request (ValueError if it is refused, QueueFullError if too many wait,
        EngineDeadError if the engine is gone) and return its stream of outputs. The request is
        aborted if the consumer stops early (for instance a client disconnects)."""
        self._check_alive()
        self.check_room()
        stream: asyncio.Queue = asyncio.Queue()
        done = self._loop.create_future()
        with self._lock:
            self._check_alive()
            self._adds_sent += 1
            self._send(_Add(request_id, prompt, params, cache_salt, stream, done))
        await done  # re-raises the engine's ValueError for a refused request
        return self._iterate(request_id, stream)

    def _check_alive(self) -> None:
        if not self.healthy:
            raise EngineDeadError(self.dead_reason or "the engine is not running")

    async def _iterate(self, request_id: str, stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    async def between_steps(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """fn(engine), run by the engine thread between two steps, where the engine's state is
        whole and nothing else touches it (reading it from the event loop could catch a step
        half done); its result, or its exception. EngineDeadError if the engine is gone."""
        self._check_alive()
        done = self._loop.create_future()
        with self._lock:
            self._check_alive()
            self._send(_Call(fn, done))
        return await done

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop_until_stopped()
        except BaseException as exc:  # a bug in this loop itself: nothing can go on
            logger.exception("engine thread crashed")
            self.dead_reason = f"the engine thread crashed: {exc!r}"
        finally:
            with self._lock:
                self._closed = True
            self._fail_all(EngineDeadError(self.dead_reason or "the server is shutting down"))
            self._refuse_pending_adds()
            try:
                self.snapshot = self._stats()
            except Exception:  # a broken engine may not even report; keep the last snapshot
                logger.exception("could not read the engine's final figures")

    def _loop_until_stopped(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            self._apply_commands()
            if not self.engine.has_unfinished_requests():
                self.snapshot = self._stats()
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a failed step must not take the server down
                failures += 1
                self.num_failed_steps += 1
                logger.exception("engine step failed (%d in a row)", failures)
                self._fail_step(exc)
                if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                    self.dead_reason = f"the engine failed {failures} steps in a row: {exc!r}"
                    logger.error("engine marked dead: %s", self.dead_reason)
                    return
                self.snapshot = self._stats()
                continue
            failures = 0
            self.num_steps += 1
            self.max_batch_requests = max(self.max_batch_requests, self.engine.last_step_num_requests)
            self._deliver(outputs)
            self.snapshot = self._stats()

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Abort):
                if self._streams.pop(command.request_id, None) is not None:
                    self.engine.abort_request(command.request_id)
                continue
            if isinstance(command, _Call):
                self._run_call(command)
                continue
            try:
                self.engine.add_request(command.request_id, command.prompt, command.params,
                                        cache_salt=command.cache_salt)
            except Exception as exc:
                self._call(_resolve, command.done, exc)
                continue
            finally:
                self._adds_applied += 1
            self._streams[command.request_id] = command.stream
            self._call(_resolve, command.done, None)

    def _run_call(self, command: _Call) -> None:
        try:
            result = command.fn(self.engine)
        except Exception as exc:
            self._call(_resolve, command.done, exc)
            return
        self._call(_resolve, command.done, None, result)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
                if self.on_finished is not None:
                    self._call(self.on_finished, output)
            self._call(stream.put_nowait, output)

    def _fail_step(self, exc: Exception) -> None:
        """Fail the requests the failed step scheduled (all requests if that is unknown):
        abort them, which frees their blocks, and tell their clients why."""
        request_ids = self.engine.step_request_ids
        if request_ids is None:
            self._fail_all(exc)
            return
        error = RequestFailed(f"the engine failed while running this request: {exc!r}")
        for request_id in request_ids:
            self._abort_quietly(request_id)
            self.num_failed_requests += 1
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                self._call(stream.put_nowait, error)

    def _fail_all(self, exc: Exception) -> None:
        """Abort every request in flight (freeing its blocks) and tell its client why."""
        error = exc if isinstance(exc, EngineDeadError) else RequestFailed(
            f"the engine failed while running this request: {exc!r}")
        for request_id, stream in list(self._streams.items()):
            self._abort_quietly(request_id)
            self.num_failed_requests += 1
            self._call(stream.put_nowait, error)
        self._streams.clear()

    def _abort_quietly(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:  # the engine is broken already; the client still hears why
            logger.exception("could not abort %s", request_id)

    def _refuse_pending_adds(self) -> None:
        """Answer adds and calls the thread will never apply, so nobody waits for them."""
        error = EngineDeadError(self.dead_reason or "the server is shutting down")
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._adds_applied += 1
            if isinstance(command, (_Add, _Call)):
                self._call(_resolve, command.done, error)

    def _call(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _stats(self) -> dict:
        stats = self.engine.memory_stats()
        stats["num_requests_running"] = self.engine.scheduler.num_running
        stats["num_requests_waiting"] = self.engine.scheduler.num_waiting
        stats["prompt_tokens_total"] = self.engine.num_prompt_tokens_total
        stats["generation_tokens_total"] = self.engine.num_generation_tokens_total
        return stats


def _resolve(future: asyncio.Future, exc: Exception | None, result: Any = None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(result)
    else:
        future.set_exception(exc)
