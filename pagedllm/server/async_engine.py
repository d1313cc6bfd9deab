"""The engine under asyncio, in the API process: the input and output processors run in the event
loop; the engine core runs in a process of its own (pagedllm/engine/core_process.py), reached through a
CoreProcess (pagedllm/engine/core_client.py).

The event loop checks and tokenizes requests (input processor), sends the core each request and
each abort, and turns the core's StepReports into RequestOutputs (output processor: text, stop
strings, deltas) for per-request asyncio queues. A stop string found here ends its sequence in the
core too (AbortSequences); a client that goes away aborts its request, whose blocks the core frees
at once. Nothing here waits for the core except a request's add (so that a request the core
refuses still gets its 400) and the dashboard's snapshots.

Faults: a step that fails ends only its requests: the core says which, and their clients get the
error (RequestFailed). A core that gives up (too many failed steps in a row), crashes or is
killed is dead: every request fails (EngineDeadError), /health says 503, and `on_dead` is called
once with the reason (`pagedllm serve` then shuts the server down with one clear line).
Overload: at most max_waiting_requests requests wait for the engine; past that, new ones are
refused at once (QueueFullError, a 503 with Retry-After) instead of queueing without bound.
A core that stops answering (stopped, hung) fails /health (responsive()): with requests in flight
when it has sent nothing for stall_s, idle when a snapshot is not answered within that long.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec

from pagedllm.core.kv.snapshot import BlockMap
from pagedllm.engine.core_channel import (
    Abort,
    AbortSequences,
    AddRequest,
    AddsTaken,
    Dead,
    LoadLoRA,
    LoRALoaded,
    Shutdown,
    SnapshotReply,
    SnapshotRequest,
    StepReport,
)
from pagedllm.engine.core_client import CoreProcess, describe_exit
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.messages import EngineCoreRequest, EngineCoreStats
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.server.protocol import DEFAULT_MAX_WAITING_REQUESTS
from pagedllm.text.generation_defaults import read_generation_defaults
from pagedllm.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# When the core process exits, its last messages (a Dead with the reason) may still be on their
# way through the socket: they get this long to arrive before the exit itself is the reason.
_EXIT_GRACE_S = 0.5
# How long a shutdown waits for the core to finish its last step and exit before killing it.
_SHUTDOWN_TIMEOUT_S = 10.0


# /health's limit on the core's silence (AsyncEngine.responsive): far past any step of a model
# this engine serves on a CPU, so only a stopped or hung core fails it.
DEFAULT_STALL_S = 30.0


class EngineDeadError(RuntimeError):
    pass


class QueueFullError(RuntimeError):
    """Too many requests are waiting already; the client should retry later."""


class RequestFailed(RuntimeError):
    """The engine failed while running this request; the message is safe to show a client."""


class AsyncEngine:
    def __init__(self, core: CoreProcess, tokenizer: Tokenizer, on_finished=None,
                 max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS,
                 on_dead: Callable[[str], None] | None = None, stall_s: float = DEFAULT_STALL_S) -> None:
        self.check_args(max_waiting_requests)
        if core.ready is None:
            raise ValueError("the engine core has not said Ready yet: call core.wait_ready() first")
        self.core = core
        self.ready = core.ready  # what the core said at start-up: model, max_model_len, ...
        self.input_processor = InputProcessor(
            tokenizer, self.ready.vocab_size, self.ready.max_model_len,
            sampling_defaults=read_generation_defaults(core.config.generation_config,
                                                       Path(self.ready.model_path)),
            pooling=self.ready.pooling, scheduling_policy=core.config.scheduling_policy,
            max_logprobs=core.config.max_logprobs)
        self.output_processor = OutputProcessor(tokenizer)
        self.on_finished = on_finished  # called in the event loop with each final RequestOutput
        # Called in the event loop with each request the core took, and with each step report
        # (the metrics: server/metrics.py).
        self.on_added: Callable[[EngineCoreRequest], None] | None = None
        self.on_report: Callable[[StepReport], None] | None = None
        self.num_failed_requests = 0  # ended by a failed engine step (/metrics counts them)
        self.on_dead = on_dead  # called once in the event loop with the reason the core died
        self.max_waiting_requests = max_waiting_requests
        self.stats: EngineCoreStats = self.ready.stats  # the core's figures, as last reported
        self._streams: dict[str, asyncio.Queue] = {}
        self._pending_adds: deque[tuple[str, asyncio.Future]] = deque()  # in the order sent
        self._adds_sent = 0
        self._adds_taken = 0  # by the core, as last reported
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task | None = None
        self._closed = False
        self.dead_reason: str | None = None
        self.stall_s = stall_s
        self._last_heard = time.monotonic()  # when the core last sent anything
        self.num_rejected_requests = 0  # refused because the waiting queue was full
        self.max_batch_requests = 0  # the most requests one step has run: evidence of batching

    @staticmethod
    def check_args(max_waiting_requests: int | None = None) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be at least 1; got {max_waiting_requests}")

    @property
    def model_path(self) -> str:
        return self.ready.model_path

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._reader = self._loop.create_task(self._read())
        self.core.watch(self._exited_threadsafe)

    async def stop(self) -> None:
        """Stop the core (it aborts what is left) and fail whatever still waits for it."""
        if self._closed:
            return
        self._closed = True
        if self.core.process.poll() is None:
            self.core.send(Shutdown())
            if await asyncio.to_thread(self.core.wait_exit, _SHUTDOWN_TIMEOUT_S) is None:
                logger.error("the engine core did not exit within %.0f s; killing it", _SHUTDOWN_TIMEOUT_S)
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._fail_everything(EngineDeadError(self.dead_reason or "the server is shutting down"))
        self.core.close()

    @property
    def healthy(self) -> bool:
        return (self._reader is not None and not self._closed and self.dead_reason is None
                and self.core.process.poll() is None)

    async def responsive(self) -> bool:
        """Healthy, and the core answering: with requests in flight it sent something within
        stall_s (a step report at least; a step longer than that on this model is a hang), idle
        it answers a snapshot within stall_s. A stopped (SIGSTOP) or hung core fails this."""
        if not self.healthy:
            return False
        if self.has_unfinished_requests():
            return time.monotonic() - self._last_heard < self.stall_s
        try:
            await asyncio.wait_for(self.snapshot(), self.stall_s)
        except (TimeoutError, EngineDeadError):
            return False
        return True

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: sent but not yet taken by the core, plus the scheduler's
        waiting queue (which also holds preempted requests) as the core last reported it. Adds
        the core took during a step show up in the figures when that step ends: until then this
        undercounts (admitting a little past the limit), rather than counting requests the step
        is running as waiting (refusing clients for nothing)."""
        return self._adds_sent - self._adds_taken + self.stats.num_waiting

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
        if not self.has_unfinished_requests():  # the core's silence until now was idleness
            self._last_heard = time.monotonic()
        self.output_processor.add_request(request, prompt)  # ValueError if the id is in use
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        taken = self._loop.create_future()
        self._pending_adds.append((request_id, taken))
        self._adds_sent += 1
        try:
            self.core.send(AddRequest(request))
            await taken  # re-raises the core's ValueError for a refused request
        except BaseException:
            self.abort(request_id)  # cancelled while the core may have taken it: end it there
            raise
        if self.on_added is not None:
            self.on_added(request)
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
        if self._forget(request_id) and not self._closed:
            self.core.send(Abort([request_id]))

    def _forget(self, request_id: str) -> bool:
        """Drop a request's stream and output state; True if it was still unfinished."""
        self._streams.pop(request_id, None)
        return self.output_processor.abort_request(request_id)

    async def snapshot(self) -> tuple[EngineCoreStats, BlockMap]:
        """The core's figures and KV block map, taken between two of its steps. EngineDeadError
        if the engine is gone."""
        reply = await self._call(SnapshotRequest)
        return reply.stats, reply.blocks

    async def load_lora(self, lora: LoRARequest) -> None:
        """Have the core read and check a LoRA adapter; ValueError (one line naming it) if it
        cannot be served, EngineDeadError if the engine is gone."""
        reply = await self._call(LoadLoRA, lora=lora)
        if reply.error is not None:
            raise ValueError(reply.error)

    async def _call(self, message_type, **fields):
        self._check_alive()
        call_id = next(self._call_ids)
        answer = self._loop.create_future()
        self._calls[call_id] = answer
        try:
            self.core.send(message_type(call_id=call_id, **fields))
            return await answer
        finally:
            self._calls.pop(call_id, None)

    # -- what the core sends -------------------------------------------------------------------
    async def _read(self) -> None:
        try:
            while True:
                try:
                    message = await self.core.receive()
                except msgspec.DecodeError as exc:
                    logger.error("dropped a malformed message from the engine core: %s", exc)
                    continue
                try:
                    self._on_message(message)
                except Exception:  # a bug here must not stop every stream's news
                    logger.exception("could not handle the engine core's %s", type(message).__name__)
        except Exception as exc:  # the socket itself failed: no news will come again
            logger.exception("lost the channel to the engine core")
            self._die(f"lost the channel to the engine core: {exc!r}")

    def _on_message(self, message) -> None:
        self._last_heard = time.monotonic()
        if isinstance(message, StepReport):
            self._on_report(message)
        elif isinstance(message, AddsTaken):
            self._take_adds(message)
        elif isinstance(message, SnapshotReply | LoRALoaded):
            answer = self._calls.get(message.call_id)
            if answer is not None and not answer.done():
                answer.set_result(message)
        elif isinstance(message, Dead):
            self._die(message.reason)

    def _on_report(self, report: StepReport) -> None:
        self.stats = report.stats
        self.max_batch_requests = max(self.max_batch_requests, report.stats.step_num_requests)
        if self.on_report is not None:
            self.on_report(report)
        if report.outputs:
            processed = self.output_processor.process_outputs(report.outputs)
            if processed.sequences_to_abort:
                self.core.send(AbortSequences(processed.sequences_to_abort))
            for output in processed.request_outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                if output.finished:
                    del self._streams[output.request_id]
                    if self.on_finished is not None:
                        self.on_finished(output)
                stream.put_nowait(output)
        if report.failed:
            self.num_failed_requests += len(report.failed)
            self._fail_requests(report.failed, RequestFailed(
                f"the engine failed while running this request: {report.failure}"))

    def _take_adds(self, taken: AddsTaken) -> None:
        """Answer the adds the core has taken since it last said, in the order they were sent."""
        rejected = dict(taken.rejected)
        for _ in range(taken.num_added - self._adds_taken):
            request_id, answer = self._pending_adds.popleft()
            reason = rejected.get(request_id)
            _resolve(answer, None if reason is None else ValueError(reason))
        self._adds_taken = taken.num_added

    def _fail_requests(self, request_ids: list[str], error: Exception) -> None:
        """Tell the clients of these requests why they failed (the core has ended them)."""
        for request_id in request_ids:
            self.output_processor.abort_request(request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put_nowait(error)

    # -- death ---------------------------------------------------------------------------------
    def _exited_threadsafe(self, returncode: int) -> None:
        try:
            self._loop.call_soon_threadsafe(self._exited, returncode)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _exited(self, returncode: int) -> None:
        if self._closed:
            return
        reason = f"the engine core process died ({describe_exit(returncode)})"
        self._loop.call_later(_EXIT_GRACE_S, self._die, reason)

    def _die(self, reason: str) -> None:
        """The core is gone for good: fail everything, once, and tell on_dead why."""
        if self.dead_reason is not None or self._closed:
            return
        self.dead_reason = reason
        logger.error("engine dead: %s", reason)
        self._fail_everything(EngineDeadError(reason))
        if self.on_dead is not None:
            self.on_dead(reason)

    def _fail_everything(self, error: EngineDeadError) -> None:
        self._fail_requests(list(self._streams), error)
        while self._pending_adds:
            _resolve(self._pending_adds.popleft()[1], error)
        for answer in self._calls.values():
            _resolve(answer, error)


def _resolve(future: asyncio.Future, exc: Exception | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
