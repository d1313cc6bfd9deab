"""Connection hygiene: no client can hold the server's sockets, descriptors or log.

uvicorn closes an idle keep-alive connection, but not one that never finishes its request
headers: a connection that sends only a request line (or one byte every few seconds) stays open
for ever. 1,030 of those locked every new client out, and asyncio then logged a "Too many open
files" traceback for every accept it retried: 316k of them, 140 MB of log in 45 s. So:

- request headers must arrive within header_timeout_s of the connection (or of the previous
  response, on a kept-alive one), however they trickle in: past it the connection is closed;
- at most max_connections are open: past it the oldest connection still waiting for its headers
  is closed to make room (an idle or slow client), and when none is, the oldest still waiting for
  its request body (complete headers and no body held 775 connections, reopened after each 408,
  until 69 of 70 other clients got 503s); never a request whose body arrived, which the engine
  may be running; when every connection is busy with such a request, a new one gets a fast 503
  (uvicorn's limit_concurrency);
- the open-files limit is raised to its hard limit at start-up, and the cap kept under it with a
  margin for the model's files, the engine and the log;
- repeated log lines are collapsed (RepeatLimiter), so an attack cannot fill the disk.

The body's own time limit is the app's (pagedllm.server.guard.Guard: 408 past body_timeout_s).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import resource
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import h11
from uvicorn.config import LOGGING_CONFIG
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedllm.server.protocol import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_S,
    DEFAULT_MAX_CONNECTIONS,
)

logger = logging.getLogger(__name__)

# Descriptors kept for everything but client connections: model files, the engine, logs, pipes.
FD_MARGIN = 256
_NO_LIMIT = 1 << 20  # what "unlimited" open files comes to


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be at least 1; got {self.max_connections}")
        for name in ("header_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive; got {getattr(self, name)}")


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return _NO_LIMIT
    # Linux refuses more than fs.nr_open (2^20 by default) even under an unlimited hard limit.
    target = _NO_LIMIT if hard == resource.RLIM_INFINITY else hard
    if soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:  # some containers refuse; keep the soft limit
        logger.warning("could not raise the open-files limit from %d to %d: %s", soft, target, exc)
        return soft
    return target


def fit_to_open_files(limits: ConnectionLimits) -> ConnectionLimits:
    """limits with max_connections kept FD_MARGIN under the open-files limit (raised first)."""
    available = raise_open_files_limit() - FD_MARGIN
    if limits.max_connections <= available:
        return limits
    fitted = max(1, available)
    logger.warning("--max-connections %d is more than the open-files limit allows; serving at most "
                   "%d connections (raise `ulimit -n` for more)", limits.max_connections, fitted)
    return replace(limits, max_connections=fitted)


def uvicorn_settings(limits: ConnectionLimits) -> dict:
    """Keyword arguments for uvicorn.run / uvicorn.Config that apply limits."""
    return dict(http=guarded_protocol(limits), limit_concurrency=limits.max_connections + 1,
                timeout_keep_alive=limits.keep_alive_s, log_config=_log_config())


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header deadline and the connection cap; one class per
    server (it keeps that server's connections waiting for headers, oldest first)."""
    waiting: OrderedDict[H11Protocol, None] = OrderedDict()
    bodies: OrderedDict[H11Protocol, None] = OrderedDict()  # headers in, body not yet: oldest first
    closing: set[H11Protocol] = set()  # closed by us, until their connection_lost

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            excess = len(self.connections) - len(closing) - limits.max_connections
            while excess > 0 and (waiting or bodies):
                oldest, _ = (waiting or bodies).popitem(last=False)
                oldest._close("the connection cap was reached")
                excess -= 1
            self._wait_for_headers()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._check_headers_arrived()
            if self in bodies and self.conn.their_state is not h11.SEND_BODY:
                bodies.pop(self)  # its body is in: a request the app may be running

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._wait_for_headers()  # the next request on this kept-alive connection
            self._check_headers_arrived()  # a pipelined one may be parsed already

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_waiting()
            bodies.pop(self, None)
            closing.discard(self)
            super().connection_lost(exc)

        def _wait_for_headers(self) -> None:
            self._stop_waiting()
            waiting[self] = None
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._close,
                                                      "its request headers did not arrive in time")

        def _check_headers_arrived(self) -> None:
            if self in waiting and self.conn.their_state is not h11.IDLE:
                self._stop_waiting()
                if self.conn.their_state is h11.SEND_BODY:
                    bodies[self] = None

        def _stop_waiting(self) -> None:
            waiting.pop(self, None)
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _close(self, why: str) -> None:
            self._stop_waiting()
            bodies.pop(self, None)
            if not self.transport.is_closing():
                closing.add(self)
                logger.debug("closing a connection from %s: %s", self.client, why)
                self.transport.close()

    return GuardedH11Protocol


class RepeatLimiter(logging.Filter):
    """Lets through at most `burst` records of one kind (logger, level, message template) per
    `window_s`; the first one after a quiet spell says how many were left out. An attack that
    makes the same error a million times costs a few lines a window, not the disk."""

    MAX_KINDS = 1024  # kinds remembered; past it the memory starts afresh

    def __init__(self, burst: int = 5, window_s: float = 10.0, clock=time.monotonic) -> None:
        super().__init__()
        self.burst = burst
        self.window_s = window_s
        self.clock = clock
        self._kinds: dict[tuple, list] = {}  # kind -> [window start, passed, suppressed]

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        state = self._kinds.get(kind)
        if state is None or now - state[0] > self.window_s:
            if len(self._kinds) >= self.MAX_KINDS:
                self._kinds.clear()
            suppressed = state[2] if state is not None else 0
            self._kinds[kind] = [now, 1, 0]
            if suppressed:
                record.msg = f"{record.msg} [{suppressed} more like this left out of the log]"
            return True
        if state[1] < self.burst:
            state[1] += 1
            return True
        state[2] += 1
        return False


_REPEAT_LIMITER = RepeatLimiter()


def limit_repeated_log_lines() -> None:
    """Put the repeat limiter on the root logger's handlers (pagedllm's and asyncio's lines)."""
    for handler in logging.getLogger().handlers:
        if _REPEAT_LIMITER not in handler.filters:
            handler.addFilter(_REPEAT_LIMITER)


def _log_config() -> dict:
    """uvicorn's logging configuration with the repeat limiter on its handlers."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["filters"] = {"repeats": {"()": lambda: _REPEAT_LIMITER}}
    for handler in config["handlers"].values():
        handler["filters"] = ["repeats"]
    return config
