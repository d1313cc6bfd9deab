"""What a stopped server leaves in the way of the next one (issue 32, findings 7 and 8): socket
folders a SIGKILLed server left are removed by the next start (a live server's are kept), and a
used port stops `pagedllm serve` before the model loads."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

from pagedllm.server.stale_sockets import PREFIX, remove_stale_socket_dirs


def _folder(tmp_path, name: str, listening: bool) -> tuple[str, socket.socket]:
    path = tmp_path / f"{PREFIX}{name}"
    path.mkdir(mode=0o700)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path / "to-core"))
    if listening:
        server.listen()
    return str(path), server


def test_a_folder_without_a_listener_is_removed_and_a_live_one_kept(tmp_path):
    stale, dead = _folder(tmp_path, "stale", listening=False)
    dead.close()  # as a killed process leaves it: the socket file, nobody behind it
    live, alive = _folder(tmp_path, "live", listening=True)
    (tmp_path / "unrelated").mkdir()
    try:
        assert remove_stale_socket_dirs(str(tmp_path)) == [stale]
        assert not os.path.exists(stale) and os.path.exists(live)
        assert (tmp_path / "unrelated").exists()
    finally:
        alive.close()


def test_an_empty_folder_is_kept_while_a_server_may_be_starting(tmp_path):
    starting = tmp_path / f"{PREFIX}starting"
    starting.mkdir()
    assert remove_stale_socket_dirs(str(tmp_path)) == []
    old = time.time() - 3600
    os.utime(starting, (old, old))
    assert remove_stale_socket_dirs(str(tmp_path)) == [str(starting)]


def test_the_folder_of_a_sigkilled_process_is_removed_by_the_next_sweep(tmp_path):
    """A child binds its channel's addresses as the API process does (zmq, ipc) and is killed."""
    script = textwrap.dedent(f"""
        import sys, tempfile, zmq
        tempfile.tempdir = {str(tmp_path)!r}
        from pagedllm.engine.core_channel import Addresses
        addresses = Addresses()
        context = zmq.Context()
        sockets = [context.socket(zmq.PUSH) for _ in range(2)]
        for sock, address in zip(sockets, (addresses.to_core, addresses.from_core)):
            sock.bind(address)
        print(addresses.directory, flush=True)
        sys.stdin.read()
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    directory = child.stdout.readline().strip()
    try:
        assert os.path.isdir(directory)
        assert remove_stale_socket_dirs(str(tmp_path)) == []  # alive: kept
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert os.path.isdir(directory)  # SIGKILL ran no clean-up
    assert remove_stale_socket_dirs(str(tmp_path)) == [directory]


def test_a_used_port_stops_serve_before_any_model_load(capsys, core_starts):
    """Issue 32, finding 8: a second server on a used port loaded the whole model first."""
    from pagedllm.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "/nowhere/at/all", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err
    assert core_starts == []
