"""Small helpers several parts need and none owns. No torch here."""

from __future__ import annotations

import functools
from pathlib import Path


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
