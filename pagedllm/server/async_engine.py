"""The engine's three parts under asyncio: the core steps in a background thread; the input and
output processors run in the event loop.

The event loop checks and tokenizes requests (input processor), hands the core its
EngineCoreRequests and aborts as commands, and turns each step's EngineCoreOutputs into
RequestOutputs (output processor: text, stop strings, deltas) for per-request asyncio queues.
The thread only applies commands and steps the core, and sends back each step's outputs and
figures; it steps while there is work and sleeps on an event when there is none, so an idle
server uses no CPU. Nothing in the event loop touches the core: the core could as well be in
another process, behind a channel carrying the same messages.

Faults: a step that fails (engine_core.StepError) fails only the requests it ran: the core has
aborted them (their blocks are back) and their clients get the error; the thread goes on with
the rest. Several failed steps in a row mean the engine itself is broken: it is marked dead,
every request fails, /health says 503. Overload: at most max_waiting_requests requests wait for
the engine; past that, new ones are refused at once (QueueFullError, a 503 with Retry-After)
instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pagedllm.core_messages import EngineCoreOutput, EngineCoreRequest, EngineCoreStats
from pagedllm.engine import LLMEngine
from pagedllm.engine_core import EngineCore, StepError
from pagedllm.outputs import RequestOutput
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
    request: EngineCoreRequest
    done: asyncio.Future


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _AbortSequences:
    sequences: list[tuple[str, int]]


@dataclass
class _Call:
    fn: Callable[[EngineCore], Any]
    done: asyncio.Future


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_finished=None,
                 max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS) -> None:
        self.check_args(max_waiting_requests)
        self.engine = engine  # for what it was built with (model, max_model_len); never stepped
        self.input_processor = engine.input_processor  # event loop
        self.output_processor = engine.output_processor  # event loop
        self._core = engine.engine_core  # the engine thread only
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
        self._streams: dict[str, asyncio.Queue] = {}  # event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.dead_reason: str | None = None
        self.stats: EngineCoreStats = self._core.stats()  # the core's figures, as last published
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
        (which also holds preempted requests) as the core last published it. Adds the thread
        applied during a step show up in the figures when that step ends: until then this
        undercounts (admitting a little past the limit), rather than counting requests the
        step is running as waiting (refusing clients for nothing)."""
        return self._adds_sent - self._adds_applied + self.stats.num_waiting

    def check_room(self, num_requests: int = 1) -> None:
        """QueueFullError if num_requests more would pass max_waiting_requests."""
        limit = self.max_waiting_requests
        if limit is not None and self.num_waiting + num_requests > limit:
            self.num_rejected_requests += 1
            raise QueueFullError(f"the server is overloaded: {self.num_waiting} requests are "
                                 f"waiting (the limit is {limit}); retry later")

    def has_unfinished_requests(self) -> bool:
        """Requests whose final output has not gone out yet (event loop's view)."""
        return self.output_processor.has_unfinished_requests()

    # -- requests ------------------------------------------------------------------------------
    async def generate(self, request: EngineCoreRequest, prompt: str | None) -> AsyncIterator[RequestOutput]:
        """Add a request made by the input processor (ValueError if the core refuses it,
        QueueFullError if too many wait, EngineDeadError if the engine is gone) and return its
        stream of outputs. The request is aborted if the consumer stops early (for instance a
        client disconnects)."""
        self._check_alive()
        self.check_room()
        request_id = request.request_id
        self.output_processor.add_request(request, prompt)  # ValueError if the id is in use
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        done = self._loop.create_future()
        try:
            with self._lock:
                self._check_alive()
                self._adds_sent += 1
                self._send(_Add(request, done))
            await done  # re-raises the core's ValueError for a refused request
        except BaseException:
            self._forget(request_id)
            raise
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
        if self._forget(request_id):
            self._send(_Abort([request_id]))

    def _forget(self, request_id: str) -> bool:
        """Drop a request's stream and output state; True if it was still unfinished."""
        self._streams.pop(request_id, None)
        return self.output_processor.abort_request(request_id)

    async def between_steps(self, fn: Callable[[EngineCore], Any]) -> Any:
        """fn(core), run by the engine thread between two steps, where the engine's state is
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

    # -- the event loop's side of each step -------------------------------------------------
    def _on_step(self, outputs: list[EngineCoreOutput]) -> None:
        processed = self.output_processor.process_outputs(outputs)
        if processed.sequences_to_abort:
            self._send(_AbortSequences(processed.sequences_to_abort))
        for output in processed.request_outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
                if self.on_finished is not None:
                    self.on_finished(output)
            stream.put_nowait(output)

    def _fail_requests(self, request_ids: list[str] | None, error: Exception) -> None:
        """Tell the clients of these requests (None: of all) why they failed. The core has
        aborted them already (all: those it had; aborting again covers any added since)."""
        if request_ids is None:
            request_ids = list(self._streams)
            self._send(_Abort(request_ids))
        for request_id in request_ids:
            self.num_failed_requests += 1
            self.output_processor.abort_request(request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put_nowait(error)

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
                self.stats = self._core.stats()
            except Exception:  # a broken engine may not even report; keep the last figures
                logger.exception("could not read the engine's final figures")

    def _loop_until_stopped(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            self._apply_commands()
            if not self._core.has_unfinished_requests():
                self.stats = self._core.stats()
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                step = self._core.step()
            except Exception as exc:  # a failed step must not take the server down
                failures += 1
                self.num_failed_steps += 1
                if isinstance(exc, StepError):  # the core logged the cause with its traceback
                    logger.error("engine step failed (%d in a row): %r", failures, _cause(exc))
                else:
                    logger.exception("engine step failed (%d in a row)", failures)
                self._fail_step(exc)
                if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                    self.dead_reason = f"the engine failed {failures} steps in a row: {_cause(exc)!r}"
                    logger.error("engine marked dead: %s", self.dead_reason)
                    return
                self.stats = self._core.stats()
                continue
            failures = 0
            self.num_steps += 1
            self.max_batch_requests = max(self.max_batch_requests, step.stats.step_num_requests)
            self.stats = step.stats
            if step.outputs:
                self._call(self._on_step, step.outputs)

    def _queued_commands(self) -> Iterator:
        """Each command sent so far, taken off the queue."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply_commands(self) -> None:
        for command in self._queued_commands():
            if isinstance(command, _Abort):
                self._core.abort_requests(command.request_ids)
            elif isinstance(command, _AbortSequences):
                self._core.abort_sequences(command.sequences)
            elif isinstance(command, _Call):
                self._run_call(command)
            else:
                try:
                    self._core.add_request(command.request)
                except Exception as exc:
                    self._call(_resolve, command.done, exc)
                    continue
                finally:
                    self._adds_applied += 1
                self._call(_resolve, command.done, None)

    def _run_call(self, command: _Call) -> None:
        try:
            result = command.fn(self._core)
        except Exception as exc:
            self._call(_resolve, command.done, exc)
            return
        self._call(_resolve, command.done, None, result)

    def _fail_step(self, exc: Exception) -> None:
        """Fail the requests the failed step ran (all requests if that is unknown)."""
        if not isinstance(exc, StepError):  # the core's state is unknown: end everything
            self._fail_all(exc)
            return
        error = RequestFailed(f"the engine failed while running this request: {_cause(exc)!r}")
        self._call(self._fail_requests, exc.request_ids, error)

    def _fail_all(self, exc: Exception) -> None:
        """Abort every request in the core (freeing its blocks) and tell every client why."""
        error = exc if isinstance(exc, EngineDeadError) else RequestFailed(
            f"the engine failed while running this request: {_cause(exc)!r}")
        try:
            self._core.abort_requests(self._core.unfinished_request_ids())
        except Exception:  # the engine is broken already; the clients still hear why
            logger.exception("could not abort the engine's requests")
        self._call(self._fail_requests, None, error)

    def _refuse_pending_adds(self) -> None:
        """Answer adds and calls the thread will never apply, so nobody waits for them."""
        error = EngineDeadError(self.dead_reason or "the server is shutting down")
        for command in self._queued_commands():
            if isinstance(command, _Add):
                self._adds_applied += 1
            if isinstance(command, (_Add, _Call)):
                self._call(_resolve, command.done, error)

    def _call(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _cause(exc: BaseException) -> BaseException:
    """What really failed: a StepError's cause, else the exception itself."""
    return exc.__cause__ if isinstance(exc, StepError) and exc.__cause__ is not None else exc


def _resolve(future: asyncio.Future, exc: Exception | None, result: Any = None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(result)
    else:
        future.set_exception(exc)
