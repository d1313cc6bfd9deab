"""Socket folders a killed server left behind, removed when the next one starts.

The API process binds the engine core's two sockets in a fresh `pagedllm-core-*` folder in the
temp directory (pagedllm.engine.core_channel.Addresses) and removes it when it stops. A server
killed with SIGKILL runs no clean-up, and every such kill left a folder (issue 32, finding 7).
So `pagedllm serve` sweeps them at start: a folder is stale when its sockets have no listener (a
connect is refused: the process that bound them is gone), or when it holds no socket at all and
is older than a start-up could take. A live server's folder answers the connect and is kept.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
import stat
import tempfile
import time

logger = logging.getLogger(__name__)

PREFIX = "pagedllm-core-"
# A folder with no socket yet may belong to a server that is starting right now.
EMPTY_GRACE_S = 600.0


def remove_stale_socket_dirs(temp_dir: str | None = None) -> list[str]:
    """Remove this user's stale pagedllm-core-* folders in temp_dir (default: the temp
    directory); the paths removed."""
    temp_dir = temp_dir or tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(temp_dir) if n.startswith(PREFIX)]
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(temp_dir, name)
        try:
            if os.lstat(path).st_uid != os.getuid() or not os.path.isdir(path) or not _is_stale(path):
                continue
        except OSError:  # gone meanwhile, or not ours to read
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        logger.info("removed %d socket folder(s) a stopped server left in %s", len(removed), temp_dir)
    return removed


def _is_stale(path: str) -> bool:
    sockets = [os.path.join(path, n) for n in os.listdir(path)]
    sockets = [p for p in sockets if _is_socket(p)]
    if not sockets:
        return time.time() - os.stat(path).st_mtime > EMPTY_GRACE_S
    return not any(_listening(p) for p in sockets)


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def _listening(path: str) -> bool:
    """Whether a process accepts connections on the unix socket at path."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError as exc:
            return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT)
        return True
