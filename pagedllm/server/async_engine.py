"""Runs the engine in one background thread and connects it to asyncio request handlers.

The thread steps while there is work and sleeps on an event when there is none, so an idle
server uses no CPU. Handlers never touch the engine directly: adds and aborts are commands the
thread applies between steps, and outputs come back through per-request asyncio queues.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagedllm.engine import LLMEngine
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_CONSECUTIVE_STEP_FAILURES = 3


class EngineDeadError(RuntimeError):
    pass


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


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_finished=None) -> None:
        self.engine = engine
        self.on_finished = on_finished  # called in the event loop with each final RequestOutput
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.dead_reason: str | None = None
        self.snapshot: dict = self._stats()
        self.num_steps = 0
        self.max_batch_requests = 0  # the most requests one step has run: evidence of batching

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
        return self.dead_reason is None and self._thread is not None and self._thread.is_alive()

    # -- requests ------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: dict, params: SamplingParams,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Add a request (ValueError if it is refused) and return its stream of outputs. The
        request is aborted if the consumer stops early (for instance a client disconnects)."""
        if not self.healthy:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        stream: asyncio.Queue = asyncio.Queue()
        done = self._loop.create_future()
        self._send(_Add(request_id, prompt, params, cache_salt, stream, done))
        await done  # re-raises the engine's ValueError for a refused request
        return self._iterate(request_id, stream)

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

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
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
                failures = 0
            except Exception as exc:  # a failed step must not take the server down
                failures += 1
                logger.exception("engine step failed (%d in a row)", failures)
                self._fail_all(exc)
                if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                    self.dead_reason = f"the engine failed {failures} steps in a row: {exc}"
                    logger.error("engine marked dead: %s", self.dead_reason)
                    return
                continue
            self.num_steps += 1
            self.max_batch_requests = max(self.max_batch_requests, self.engine.last_step_num_requests)
            self._deliver(outputs)
            self.snapshot = self._stats()
        self._fail_all(EngineDeadError("the server is shutting down"))

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
            try:
                self.engine.add_request(command.request_id, command.prompt, command.params,
                                        cache_salt=command.cache_salt)
            except Exception as exc:
                self._call(_resolve, command.done, exc)
                continue
            self._streams[command.request_id] = command.stream
            self._call(_resolve, command.done, None)

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

    def _fail_all(self, exc: Exception) -> None:
        """Abort every request in flight (freeing its blocks) and tell its client why."""
        error = RequestFailed(f"the engine failed while running this request: {exc}")
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            self._call(stream.put_nowait, error)
        self._streams.clear()

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


def _resolve(future: asyncio.Future, exc: Exception | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
