"""Connection hygiene (issue 24's probe): connections that never finish their request headers are
closed, 2,000 idle connections leave new clients served, a body sent too slowly gets 408, the
open-files limit is raised at start-up, and a log line repeated without end is collapsed."""

from __future__ import annotations

import logging
import resource
import socket
import subprocess
import sys
import time

import httpx
import pytest
import uvicorn

from pagedllm.server.connections import (
    FD_MARGIN,
    ConnectionLimits,
    RepeatLimiter,
    fit_to_open_files,
    uvicorn_settings,
)
from tests.conftest import wait_until_healthy
from tests.server.conftest import RunningServer, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HEADER_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 500
IDLE_CONNECTIONS = 2000


def guarded_server(config, limits: ConnectionLimits, **app_kwargs) -> RunningServer:
    """A RunningServer whose uvicorn applies limits, as `pagedllm serve` does."""
    running = RunningServer(config, **app_kwargs)
    config = uvicorn.Config(running.app, host="127.0.0.1", port=running.port, log_level="warning",
                            **uvicorn_settings(limits))
    running.server = uvicorn.Server(config)
    running.thread.__init__(target=running.server.run, daemon=True)
    return running


@pytest.fixture(scope="module")
def conn_server(tiny_model_dir, one_torch_thread):
    limits = ConnectionLimits(max_connections=MAX_CONNECTIONS, header_timeout_s=HEADER_TIMEOUT_S)
    with guarded_server(tiny_config(tiny_model_dir), limits, body_timeout_s=1.0) as running:
        yield running


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes sock (reading b"" or a reset) within within_s."""
    sock.settimeout(within_s)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def served(server) -> bool:
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=10,
                          json={"prompt": "hi", "max_tokens": 2})
    return response.status_code == 200


def test_request_line_that_never_finishes_is_closed(conn_server):
    with connect(conn_server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        assert closed_by_server(sock, HEADER_TIMEOUT_S + 5)


def test_headers_trickled_byte_by_byte_are_cut_at_the_deadline(conn_server):
    """A byte every 50 ms keeps the connection busy but never finishes the headers: the server
    closes it at its header deadline, long before the trickle would end."""
    header = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
    trickle = header[:int((HEADER_TIMEOUT_S + 5) / 0.05)]  # 6 s of it, at most
    with connect(conn_server) as sock:
        closed = False
        for byte in trickle:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.05)
        assert closed or closed_by_server(sock, 1)


def test_idle_connections_leave_new_clients_served(conn_server):
    idle = []
    try:
        for _ in range(IDLE_CONNECTIONS):
            idle.append(connect(conn_server))
            if len(idle) % 200 == 0:
                assert served(conn_server)
        assert served(conn_server)
        # The oldest were closed to make room: a new client never waits on the header timeout.
        assert closed_by_server(idle[0], 2)
    finally:
        for sock in idle:
            sock.close()
    assert served(conn_server)


def test_connections_that_never_send_their_body_leave_new_clients_served(tiny_model_dir):
    """Issue 32, finding 8: complete POST headers and no body, on more connections than the cap,
    each read by the server before the next comes: the oldest of them are closed to make room,
    and a new client is served, not given a 503. (Their bodies' own deadline is far off here.)"""
    cap = 40
    limits = ConnectionLimits(max_connections=cap, header_timeout_s=HEADER_TIMEOUT_S)
    headers = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    with guarded_server(tiny_config(tiny_model_dir), limits, body_timeout_s=60.0) as server:
        bodiless = []
        try:
            for _ in range(cap + 10):
                bodiless.append(sock := connect(server))
                sock.sendall(headers)
                time.sleep(0.01)  # its headers read: it waits for its body, not its headers
            assert served(server)
            assert closed_by_server(bodiless[0], 2)
        finally:
            for sock in bodiless:
                sock.close()


def test_a_slow_body_gets_408_and_the_connection_closes(conn_server):
    with connect(conn_server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        sock.settimeout(10)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(4096)  # the socket's timeout bounds each wait
            assert chunk, f"the server closed the connection without a whole answer: {answer!r}"
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408")
        assert b"connection: close" in answer.lower()
        assert closed_by_server(sock, 5)


def test_open_files_limit_is_raised_at_start_up():
    # A child process: lowering the limit is for good in the process that does it.
    code = (
        "import resource\n"
        "from pagedllm.server.connections import ConnectionLimits, fit_to_open_files\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))\n"
        "limits = fit_to_open_files(ConnectionLimits(max_connections=10**6))\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard, limits.max_connections)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    soft, hard, cap = map(int, out.stdout.split())
    assert soft == hard
    assert cap == hard - FD_MARGIN


def test_connection_cap_stays_under_the_open_files_limit():
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert fit_to_open_files(ConnectionLimits(max_connections=10)).max_connections == 10
    assert fit_to_open_files(ConnectionLimits(max_connections=10**7)).max_connections <= soft - FD_MARGIN


def test_repeated_log_lines_are_collapsed(caplog):
    log = logging.getLogger("tests.repeats")
    now = [0.0]
    limiter = RepeatLimiter(burst=5, window_s=10, clock=lambda: now[0])
    caplog.handler.addFilter(limiter)
    try:
        with caplog.at_level(logging.ERROR, logger="tests.repeats"):
            for _ in range(10_000):
                try:
                    raise OSError(24, "Too many open files")
                except OSError:
                    log.exception("socket.accept() out of system resource")
                log.error("another kind %d", 1)
            now[0] += 11
            log.exception("socket.accept() out of system resource")
    finally:
        caplog.handler.removeFilter(limiter)
    accept_lines = [r for r in caplog.records if r.getMessage().startswith("socket.accept()")]
    assert len(accept_lines) == 6
    assert "9995 more like this left out" in accept_lines[-1].getMessage()
    assert sum(r.getMessage().startswith("another kind") for r in caplog.records) == 5


def serve_process(model_dir, port: int, *flags: str, nofile_soft: int | None = None,
                  env: dict | None = None, stderr=subprocess.PIPE) -> subprocess.Popen:
    """`pagedllm serve` on the tiny model as a real process (optionally with a low open-files
    soft limit, as many shells give), once its /health answers."""
    def lower_limit() -> None:
        if nofile_soft is not None:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile_soft, hard))

    process = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.cli", "serve", "--model", str(model_dir), "--dtype",
         "float32", "--kv-cache-memory", "4MiB", "--port", str(port), *flags],
        stdout=subprocess.DEVNULL, stderr=stderr, text=True, preexec_fn=lower_limit, env=env)
    def exited() -> str | None:
        if process.poll() is None:
            return None
        return process.stderr.read() if process.stderr else ""

    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", 120, exited, interval_s=0.2)
    except AssertionError:
        process.kill()
        raise
    return process


def test_idle_connections_leave_a_real_server_serving(tiny_model_dir, tmp_path):
    """The probe: a shell's 1024 open files, 2,000 connections that send nothing. The server
    raises its limit at start-up (and keeps its cap under it), so new clients are served and the
    log stays short."""
    from tests.server.conftest import free_port

    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        process = serve_process(tiny_model_dir, port, "--header-timeout-s", "60", nofile_soft=1024,
                                stderr=log)
        idle = []
        try:
            for _ in range(IDLE_CONNECTIONS):
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=20,
                                  json={"prompt": "hi", "max_tokens": 2})
            assert response.status_code == 200
        finally:
            for sock in idle:
                sock.close()
            process.terminate()
            process.wait(timeout=60)
    assert len(log_path.read_text().splitlines()) < 100
