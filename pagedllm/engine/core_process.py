"""The engine core in a process of its own: the core's side of pagedllm.engine.core_channel.

`pagedllm serve` starts `python -m pagedllm.engine.core_process` (pagedllm/engine/core_client.py), which
loads the model itself, allocates the KV cache and says Ready. Then one loop: take every message
waiting (requests to add, aborts, snapshot requests), run one step, send ONE StepReport with the
new token ids of every sequence in it. While requests are running the loop never waits; with none
it blocks on its input socket, so an idle core uses no CPU. Text, HTTP and tokenizers stay in the
API process; so the model step never shares a GIL (nor an event loop) with them.

What it receives: requests already checked and tokenized (pagedllm.engine.input_processor, in the API
process) and aborts, the ones stop strings cause included. A message that does not decode is
logged and dropped; one that fails when applied is logged (an add is rejected with the reason):
neither stops the loop.

Faults: a step that fails ends only its requests (StepReport.failed says which, with the cause);
MAX_CONSECUTIVE_STEP_FAILURES failed steps in a row mean the core itself is broken: it sends Dead
with the reason and exits with status 1.

No orphans: the core dies with the API process, even when that one is killed with SIGKILL: the
kernel sends it SIGKILL when its parent dies (PR_SET_PDEATHSIG), and a watchdog thread exits when
its stdin, a pipe whose other end only the parent holds, reaches end of file (whatever killed the
parent). It ignores SIGINT and SIGTERM, which a terminal's Ctrl-C or a `kill` of the process
group send to both processes: the API process decides when the core stops (Shutdown), after its
graceful shutdown has let the running requests finish.

Extensions: `--extension MODULE` (repeatable) imports MODULE in the core process, before the model
loads (a module that does not import stops start-up with StartupFailed). Once the core is loaded,
and before Ready, its `extend(loop: CoreLoop)` is called: it may wrap the core's parts
(loop.core) and register handlers for message types of its own (loop.register(Type, handler): a
msgspec Struct with a tag no message of core_channel uses; handler(message) runs between two
steps, in the order the messages came). How an extension answers, if it does, is its own
business: nothing it sends crosses this channel. A core started without an extension refuses its
messages as it refuses any unknown one (logged and dropped). The tests inject faults into the
model step this way (tests/server/core_hooks.py); nothing in the package reads a test switch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Union

import msgspec
import psutil
import zmq

from pagedllm.config import EngineConfig
from pagedllm.engine.core_channel import (
    Abort,
    AbortSequences,
    AddRequest,
    AddsTaken,
    Codec,
    Dead,
    FromCore,
    LoadLoRA,
    LoRALoaded,
    Ready,
    Shutdown,
    SnapshotReply,
    SnapshotRequest,
    StartupFailed,
    StepReport,
    ToCore,
)
from pagedllm.utils import die_with_parent

logger = logging.getLogger(__name__)

MAX_CONSECUTIVE_STEP_FAILURES = 3


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    die_with_parent(args.parent_pid)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(args.to_core)
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)  # never block the core on a slow reader: queue instead
    outbox.setsockopt(zmq.LINGER, 5000)  # the last report still goes out on exit
    outbox.connect(args.from_core)
    try:
        loop = _start(args, inbox, outbox)
        if loop is None:
            return 2
        return loop.run()
    finally:
        inbox.close(linger=0)
        outbox.close()
        context.term()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.engine.core_process")
    parser.add_argument("--to-core", required=True)
    parser.add_argument("--from-core", required=True)
    parser.add_argument("--config", required=True, help="the EngineConfig as JSON")
    parser.add_argument("--num-threads", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--extension", action="append", default=[], metavar="MODULE",
                        help="a module whose extend(loop) may wrap the core and handle message "
                             "types of its own (see this module's docstring); repeatable")
    return parser.parse_args(argv)


def _start(args: argparse.Namespace, inbox: zmq.Socket, outbox: zmq.Socket) -> CoreLoop | None:
    """Load the model, allocate the cache and extend the loop; say Ready (and return the loop) or
    say why not."""
    import torch

    from pagedllm.engine.core import EngineCore

    codec = Codec(ToCore)
    try:
        extensions = _import_extensions(args.extension)
        config = msgspec.json.decode(args.config, type=EngineConfig)
        # Loading (dequantizing weights) uses every core: nothing is served yet.
        torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                              else os.cpu_count() or 1)
        core, loaded = EngineCore.load(config)
        torch.set_num_threads(args.num_threads)
        loop = CoreLoop(core, inbox, outbox, codec)
        for extension in extensions:
            extension.extend(loop)
    except (ValueError, FileNotFoundError, msgspec.ValidationError) as exc:
        outbox.send(codec.encode(StartupFailed(str(exc), user_error=True)))
        return None
    except Exception as exc:
        logger.exception("the engine core could not start")
        outbox.send(codec.encode(StartupFailed(f"the engine core could not start: {exc!r}", False)))
        return None
    plan = core.kv_plan
    outbox.send(codec.encode(Ready(
        pid=os.getpid(), model_path=str(loaded.path), description=core.facts.describe(loaded.weights_note),
        startup_s=time.time() - psutil.Process().create_time(), max_model_len=plan.max_model_len,
        vocab_size=loaded.config.vocab_size, num_threads=torch.get_num_threads(),
        device=str(core.device), dtype=str(core.dtype).removeprefix("torch."), stats=core.stats(),
        pooling=core.facts.pooling, max_concurrency=plan.max_concurrency)))
    return loop


def _import_extensions(names: list[str]) -> list[ModuleType]:
    """The --extension modules; ValueError (the user's to fix) for one that does not import or
    has no extend(loop)."""
    modules = []
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ValueError(f"--extension {name}: the module could not be imported ({exc})") from exc
        if not callable(getattr(module, "extend", None)):
            raise ValueError(f"--extension {name}: the module has no extend(loop) function")
        modules.append(module)
    return modules


class CoreLoop:
    """Apply what came in, step, report; block only when there is nothing to run."""

    def __init__(self, core, inbox: zmq.Socket, outbox: zmq.Socket, codec: Codec) -> None:
        self.core = core
        self.inbox = inbox
        self.outbox = outbox
        self.codec = codec
        self._handlers: dict[type, Callable[[Any], None]] = {}  # the extensions' message types
        self.num_added = 0
        self.failures = 0  # failed steps in a row
        self.stopping = False

    def run(self) -> int:
        from pagedllm.engine.core import StepError

        while not self.stopping:
            news = _News()
            num_added = self.num_added
            applied = self._apply(self._receive(block=not self.core.has_unfinished_requests()), news)
            if self.num_added != num_added:
                self._send(AddsTaken(self.num_added, news.rejected))
            outputs, stats = [], None
            if self.stopping:
                self.core.abort_requests(self.core.unfinished_request_ids())
            elif self.core.has_unfinished_requests():
                try:
                    step = self.core.step()
                    outputs, stats = step.outputs, step.stats
                    self.failures = 0  # a step whose culprits were isolated ran: the engine works
                    if step.failed:
                        logger.error("requests %s failed the model step on their own: %s",
                                     step.failed, step.failure)
                        news.failed, news.failure = list(step.failed), step.failure
                except StepError as exc:  # the core ended the step's requests and goes on
                    self._failed(news, exc.request_ids, exc.__cause__ or exc)
                except Exception as exc:  # the core's state is unknown: end everything
                    logger.exception("engine step failed outside the model run")
                    request_ids = self.core.unfinished_request_ids()
                    self.core.abort_requests(request_ids)
                    self._failed(news, request_ids, exc)
            elif not applied:
                continue
            self._send(StepReport(outputs, stats or self.core.stats(), news.failed, news.failure))
            if self.failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                reason = f"the engine failed {self.failures} steps in a row: {news.failure}"
                logger.error("engine core gives up: %s", reason)
                self._send(Dead(reason))
                return 1
        return 0

    def register(self, message_type: type[msgspec.Struct], handler: Callable[[Any], None]) -> None:
        """Decode message_type too (a tagged msgspec Struct of an extension) and hand each one
        to handler, between two steps. TypeError if its tag is one the channel already uses."""
        handlers = {**self._handlers, message_type: handler}
        self.codec = Codec(Union[ToCore, *handlers])
        self._handlers = handlers

    def _failed(self, news: _News, request_ids: list[str], cause: BaseException) -> None:
        self.failures += 1
        logger.error("engine step failed (%d in a row): %r", self.failures, cause)
        news.failed = list(request_ids)
        news.failure = repr(cause)

    # -- messages in ----------------------------------------------------------------------------
    def _receive(self, block: bool) -> list[bytes]:
        """Every message waiting; with block, wait for at least one first."""
        frames = []
        if block:
            frames.append(self.inbox.recv())
        while True:
            try:
                frames.append(self.inbox.recv(zmq.NOBLOCK))
            except zmq.Again:
                return frames

    def _apply(self, frames: list[bytes], news: _News) -> bool:
        """Apply each message, in order; False if none was a message at all."""
        applied = False
        for frame in frames:
            try:
                message = self.codec.decode(frame)
            except msgspec.DecodeError as exc:
                logger.warning("dropped a malformed message (%d bytes): %s", len(frame), exc)
                continue
            applied = True
            try:
                self._apply_one(message, news)
            except Exception:
                logger.exception("could not apply %s", type(message).__name__)
        return applied

    def _apply_one(self, message, news: _News) -> None:
        core = self.core
        if isinstance(message, AddRequest):
            self.num_added += 1
            try:
                core.add_request(message.request)
            except ValueError as exc:  # the id is in use, or it could never fit the cache
                news.rejected.append((message.request.request_id, str(exc)))
        elif isinstance(message, Abort):
            core.abort_requests(message.request_ids)
        elif isinstance(message, AbortSequences):
            core.abort_sequences(message.sequences)
        elif isinstance(message, SnapshotRequest):
            self._send(SnapshotReply(message.call_id, core.stats(), core.block_map()))
        elif isinstance(message, LoadLoRA):
            try:
                core.load_lora(message.lora)
                self._send(LoRALoaded(message.call_id))
            except ValueError as exc:
                self._send(LoRALoaded(message.call_id, str(exc)))
        elif isinstance(message, Shutdown):
            self.stopping = True
        else:
            self._handlers[type(message)](message)

    # -- messages out ---------------------------------------------------------------------------
    def _send(self, message: FromCore) -> None:
        self.outbox.send(self.codec.encode(message), copy=False)


@dataclass
class _News:
    """What one turn of the loop has to report besides the step's outputs."""

    rejected: list[tuple[str, str]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    failure: str | None = None


if __name__ == "__main__":
    sys.exit(main())
