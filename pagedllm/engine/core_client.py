"""The API process's side of pagedllm.engine.core_channel: start the engine core process, send it
messages, read what it sends back, notice when it dies.

What crosses, from here: checked, tokenized requests (EngineCoreRequest: ids, numbers, the
SamplingParams), aborts (a client gone, a stop string found here, where the text is), snapshot
requests for the dashboard, Shutdown, and the messages of the extensions the core was started
with (core_process, --extension; the tests' fault hooks). What comes back: Ready once, then
per step the new token ids of every request (StepReport), which the output processor here turns
into text. Why two processes: the model step and the HTTP front end (parsing, validation,
tokenizing, chat templates, detokenizing, SSE) then share no GIL and no event loop; each gets a
core of its own (see the threads choice in pagedllm/server/cli.py).

Start: the core process is `python -m pagedllm.engine.core_process`, made with subprocess (never
pickled: its settings go as JSON on its command line) from the thread that will live as long as
this process (the core's PR_SET_PDEATHSIG fires when that thread ends). Its stdin is a pipe
nobody writes to: when this process dies, however, the pipe closes and the core exits.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence

import msgspec
import zmq
import zmq.asyncio

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.engine.core_channel import Addresses, Codec, FromCore, Ready, StartupFailed, ToCore

logger = logging.getLogger(__name__)

_POLL_MS = 200  # how often start-up checks that the core is still alive


class CoreStartupError(ValueError):
    """The core could not start for a reason the user can fix (a bad model path, a damaged file,
    a cache too small); the message says which."""


class CoreProcess:
    """One engine core process and the two sockets to it."""

    def __init__(self, config: EngineConfig, num_threads: int, log_level: str | None = None,
                 stderr=None, extensions: Sequence[str] = ()) -> None:
        """Start the core process (its logs go to stderr: this process's unless given a file),
        with the named extension modules (core_process's --extension)."""
        self.config = config
        self.addresses = Addresses()
        self._context = zmq.Context()
        try:
            self._start(config, num_threads, log_level, stderr, extensions)
        except BaseException:
            self._context.destroy(linger=0)  # an unclosed context blocks whoever collects it
            self.addresses.remove()
            raise

    def _start(self, config, num_threads, log_level, stderr, extensions) -> None:
        self._to_core = self._context.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a busy core
        self._to_core.setsockopt(zmq.LINGER, 0)
        self._to_core.bind(self.addresses.to_core)
        self._from_core = self._context.socket(zmq.PULL)
        self._from_core.setsockopt(zmq.LINGER, 0)
        self._from_core.bind(self.addresses.from_core)
        self._codec = Codec(FromCore)
        self._encoder = Codec(ToCore)
        self._async_from_core: zmq.asyncio.Socket | None = None
        self.ready: Ready | None = None
        self._closed = False
        level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel())
        command = [sys.executable, "-m", "pagedllm.engine.core_process",
                   "--to-core", self.addresses.to_core, "--from-core", self.addresses.from_core,
                   "--config", msgspec.json.encode(config).decode(), "--num-threads", str(num_threads),
                   "--parent-pid", str(os.getpid()), "--log-level", level]
        command += [argument for name in extensions for argument in ("--extension", name)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stderr=stderr,
                                        env=envs.child_environ())

    @property
    def pid(self) -> int:
        return self.process.pid

    # -- start-up -------------------------------------------------------------------------------
    def wait_ready(self) -> Ready:
        """Block until the core has loaded the model (however long that takes) and return what it
        said; CoreStartupError if it could not (user's fault), RuntimeError otherwise."""
        poller = zmq.Poller()
        poller.register(self._from_core, zmq.POLLIN)
        while not poller.poll(_POLL_MS):
            if self.process.poll() is not None:
                self.close()
                raise RuntimeError(f"the engine core process exited during start-up "
                                   f"({describe_exit(self.process.returncode)}); see its log above")
        message = self._codec.decode(self._from_core.recv())
        if isinstance(message, StartupFailed):
            self.close()
            raise (CoreStartupError if message.user_error else RuntimeError)(message.message)
        if not isinstance(message, Ready):
            self.close()
            raise RuntimeError(f"the engine core sent {type(message).__name__} before Ready")
        self.ready = message
        return message

    # -- messages -------------------------------------------------------------------------------
    def send(self, message) -> None:
        """Queue a message for the core (never blocks), from the thread that runs the event loop
        (a ZMQ socket is not thread-safe). Once closed, nothing: the core is gone,
        and an abort for it (a client leaving during shutdown) has nobody to read it. The same
        when the core has closed its end (it is exiting): a PUSH socket without a peer would
        block the event loop until one came."""
        if self._closed:
            return
        try:
            self._to_core.send(self._encoder.encode(message), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            logger.debug("the engine core is gone: %s not sent", type(message).__name__)

    async def receive(self):
        """The next message from the core (awaited in the event loop that first called this);
        msgspec.DecodeError if what came is no message."""
        if self._async_from_core is None:
            self._async_from_core = zmq.asyncio.Socket.shadow(self._from_core.underlying)
        frame = await self._async_from_core.recv(copy=False)
        return self._codec.decode(frame.buffer)

    # -- the process ----------------------------------------------------------------------------
    def watch(self, on_exit: Callable[[int], None]) -> None:
        """Call on_exit(returncode) from a thread of its own when the core process ends."""
        def wait() -> None:
            on_exit(self.process.wait())

        threading.Thread(target=wait, name="pagedllm-core-watch", daemon=True).start()

    def wait_exit(self, timeout_s: float) -> int | None:
        """The exit status once the process ends, or None if it is still running after timeout_s."""
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def close(self) -> None:
        """Kill the process if it still runs; close the sockets and remove their directory."""
        if self._closed:
            return
        self._closed = True
        self.kill()
        if self.process.stdin is not None:
            self.process.stdin.close()
        if self._async_from_core is not None:
            self._async_from_core.close(linger=0)
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._context.term()
        self.addresses.remove()


def describe_exit(returncode: int) -> str:
    """'exit status 1' or 'killed by SIGKILL'."""
    if returncode < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


