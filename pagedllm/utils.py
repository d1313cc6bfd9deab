"""Small helpers several parts need and none owns. No torch here."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import threading
from pathlib import Path

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of b hold a items."""
    return -(-a // b)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags /proc/cpuinfo lists (empty where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(flag for line in text.splitlines() if line.startswith("flags")
                     for flag in line.split(":", 1)[1].split())


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU does bfloat16 math in hardware (AVX512-BF16 or AMX-BF16): elsewhere torch's
    bf16 GEMMs convert to fp32 inside and run several times slower than its fp32 ones."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def _call_glibc(name: str, *args: int) -> None:
    """libc's function `name`, where the process's libc has it (glibc); elsewhere nothing."""
    import ctypes

    try:
        getattr(ctypes.CDLL(None), name)(*args)
    except (OSError, AttributeError):
        pass


def keep_freed_memory_for_reuse(max_bytes: int = 512 * 2**20) -> None:
    """Let glibc's malloc keep what a step frees for the next step: the activations of a prefill
    step (tens of MiB at 4,096 tokens) otherwise come from fresh mmaps, or a heap trimmed back,
    and every 4 KiB page of them faults again each step (70k faults over the bench workload; on a
    VM with another large process resident a fault cost 7x what it does alone). Buffers up to
    max_bytes then come from the heap, and up to max_bytes of free heap stays mapped. A no-op
    where libc is not glibc."""
    _call_glibc("mallopt", _M_MMAP_THRESHOLD, max_bytes)
    _call_glibc("mallopt", _M_TRIM_THRESHOLD, max_bytes)


def release_freed_memory() -> None:
    """Hand the memory freed so far back to the OS. Loading a model frees more than it keeps (the
    file's tensors as read, dequantized or reordered copies), and glibc's malloc holds freed heap
    memory for reuse: without this the process's RSS after start-up stays that much higher (the
    default model: 55 MiB quantized, 220 MiB dequantized). A no-op where libc is not glibc."""
    _call_glibc("malloc_trim", 0)


# -- a child process that exits with its parent ------------------------------------------------
# The engine core process (started by `pagedllm serve`) and the tensor-parallel workers (started
# by the engine) exit with the process that started them, however that one ends. Two guards: the
# kernel's SIGKILL on the parent's death (PR_SET_PDEATHSIG, Linux), and a thread that sees end of
# file on stdin, a pipe whose other end only the parent holds.
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
