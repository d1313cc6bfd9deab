"""A child process that exits with the process that started it, however that one ends: the
engine core process (started by `pagedllm serve`) and the tensor-parallel workers (started by
the engine). Two guards: the kernel's SIGKILL on the parent's death (PR_SET_PDEATHSIG, Linux),
and a thread that sees end of file on stdin, a pipe whose other end only the parent holds."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Exit when process parent_pid (this one's parent) does."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the watchdog below still works
        logger.debug("PR_SET_PDEATHSIG is not available; relying on the stdin watchdog")
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(1)

    def watch_stdin() -> None:
        while os.read(0, 4096):  # the parent never writes: only end of file comes
            pass
        os._exit(1)

    threading.Thread(target=watch_stdin, name="pagedllm-parent-watchdog", daemon=True).start()
