"""The engine core in its own process: the channel refuses garbage without the core noticing, a
dead core is a 503 and (under `pagedllm serve`) a clean exit with one line, the core never
outlives the API process, and a graceful shutdown lets running requests finish."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgspec
import psutil
import pytest

import pagedllm
from pagedllm.engine.core_channel import Abort, SnapshotRequest
from pagedllm.engine.core_client import CoreProcess, CoreStartupError
from tests.conftest import wait_until_healthy
from tests.server.conftest import RunningServer, free_port, tiny_config
from tests.server.core_hooks import HookCall

BODY = {"prompt": "A normal request", "max_tokens": 8, "temperature": 0}


def complete(server, **fields) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/completions", json={**BODY, **fields}, timeout=60)


def test_malformed_messages_are_dropped_and_the_core_goes_on(tiny_model_dir, tmp_path):
    """Garbage, and a test hook's call to a core started without the hooks extension (as every
    core `pagedllm serve` starts is; tests/server/test_faults.py calls them in cores started
    with it): each is logged and dropped, nothing runs, the core serves on with the same text."""
    core_log = tmp_path / "core.log"
    with RunningServer(tiny_config(tiny_model_dir), core_log=core_log, with_hooks=False) as server:
        solo = complete(server).json()["choices"][0]["text"]
        encoder = msgspec.msgpack.Encoder()
        garbage = [
            b"\xc1 not msgpack at all",  # 0xc1 is never valid msgpack
            b"",
            encoder.encode({"type": "add", "request": {"request_id": 5}}),  # wrong field types
            encoder.encode({"type": "launch_missiles"}),  # no such message
            encoder.encode([1, 2, 3]),
            encoder.encode(HookCall("fail_steps", server.hooks.reply_to, {"when": "always"})),
            encoder.encode(Abort(["no-such-request"])),  # well formed, names nothing: skipped
            encoder.encode(SnapshotRequest(call_id=-1)) + b"trailing bytes",
        ]
        for frame in garbage:
            server.send_to_core(msgspec.Raw(frame))
        after = complete(server)
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == solo
        assert server.core.process.poll() is None
        assert httpx.get(f"{server.base_url}/health").status_code == 200
    log = core_log.read_text()
    assert log.count("dropped a malformed message") == len(garbage) - 1, log  # Abort was fine
    assert "Traceback" not in log


def test_an_extension_that_does_not_import_stops_start_up(tiny_model_dir):
    core = CoreProcess(tiny_config(tiny_model_dir), num_threads=1, extensions=["tests.no_such_module"])
    with pytest.raises(CoreStartupError, match=r"--extension tests.no_such_module: the module could "
                                               r"not be imported \(No module named 'tests.no_such_module'\)"):
        core.wait_ready()


def test_a_killed_core_is_a_503_and_running_requests_fail(tiny_model_dir):
    dead = []
    with RunningServer(tiny_config(tiny_model_dir)) as server:
        server.async_engine.on_dead = dead.append
        server.debug("slow_steps", seconds=0.05)
        with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60,
                          json={**BODY, "max_tokens": 40, "ignore_eos": True, "stream": True}) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))  # it is running
            server.core.process.kill()
            events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "engine core process died (killed by SIGKILL)" in error["message"]
        health = httpx.get(f"{server.base_url}/health")
        assert health.status_code == 503 and health.headers["retry-after"]
        assert "killed by SIGKILL" in health.json()["error"]["message"]
        refused = complete(server)
        assert refused.status_code == 503 and "killed by SIGKILL" in refused.json()["error"]["message"]
        assert dead == ["the engine core process died (killed by SIGKILL)"]
        assert not server.async_engine._streams


def test_graceful_shutdown_lets_running_requests_finish(tiny_model_dir):
    with RunningServer(tiny_config(tiny_model_dir)) as server:
        server.debug("slow_steps", seconds=0.05)
        body = {**BODY, "max_tokens": 20, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            server.server.should_exit = True  # what uvicorn does on SIGTERM or Ctrl-C
            events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        chunks = [json.loads(e) for e in events[:-1]]
        assert events[-1] == "[DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
        server.thread.join(30)
        assert server.core.wait_exit(30) == 0  # told to stop, not killed


# -- `pagedllm serve` as users run it -----------------------------------------------------------

class Serve:
    """`python -m pagedllm.cli serve` over the tiny model, in a process group of its own."""

    def __init__(self, model_dir) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.cli", "serve", "--model", str(model_dir), "--dtype",
             "float32", "--kv-cache-memory", "16MiB",
             "--num-threads", "1", "--port", str(self.port)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.stderr = ""
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()

    def _read_stderr(self) -> None:
        for line in self.process.stderr:
            self.stderr += line

    def wait_healthy(self, timeout_s: float = 120) -> psutil.Process:
        """Wait for /health; the core process."""
        wait_until_healthy(f"http://127.0.0.1:{self.port}", timeout_s,
                           lambda: None if self.process.poll() is None else self.stderr)
        (core,) = psutil.Process(self.process.pid).children()
        return core

    def finish(self, timeout_s: float = 60) -> int:
        code = self.process.wait(timeout_s)
        self._reader.join(10)
        return code

    def kill_all(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


def has_exited(process: psutil.Process, timeout_s: float) -> bool:
    """Whether the process is gone (or a zombie: it has exited, its new parent has not reaped it
    yet) within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_serve_exits_with_one_clear_line_when_its_core_dies(tiny_model_dir):
    serve = Serve(tiny_model_dir)
    try:
        core = serve.wait_healthy()
        assert "engine core ready" in serve.stderr and "1 torch thread" in serve.stderr
        core.kill()
        assert serve.finish() == 1
    finally:
        serve.kill_all()
    last = serve.stderr.strip().splitlines()[-1]
    assert last == ("pagedllm: error: the engine core process died (killed by SIGKILL); the "
                    "server stopped"), serve.stderr
    assert "Traceback" not in serve.stderr


def test_killing_serve_leaves_no_core_behind(tiny_model_dir):
    serve = Serve(tiny_model_dir)
    try:
        core = serve.wait_healthy()
        serve.process.kill()  # SIGKILL: the API process cannot clean up anything
        assert has_exited(core, timeout_s=10)
    finally:
        serve.kill_all()


def test_sigterm_to_the_process_group_stops_both_cleanly(tiny_model_dir):
    """What a service manager (or `kill -- -PGID`) does: both processes get SIGTERM; the core
    ignores it and is stopped by the API process's shutdown."""
    serve = Serve(tiny_model_dir)
    try:
        core = serve.wait_healthy()
        os.killpg(serve.process.pid, signal.SIGTERM)
        # uvicorn shuts down gracefully, then ends with the signal it caught (as it always has)
        assert serve.finish() in (0, -signal.SIGTERM), serve.stderr
        assert "Application shutdown complete" in serve.stderr
        assert has_exited(core, timeout_s=10)
    finally:
        serve.kill_all()
    assert "Traceback" not in serve.stderr and "error" not in serve.stderr.lower()


def test_the_api_process_never_imports_torch(tiny_model_dir):
    """The API side (server, input processor, a grammar compiled to check a request) leaves torch
    to the core: importing it would cost the API process seconds of start-up and ~350 MiB."""
    script = f"""
import sys
import pagedllm.server.cli, pagedllm.server.app, pagedllm.server.async_engine
from pagedllm.model.tokenizer_files import load_tokenizer
from pagedllm.structured.compiler import GrammarCompiler
from pagedllm.structured.spec import GrammarSpec
compiler = GrammarCompiler(load_tokenizer({str(tiny_model_dir)!r}))
compiler.compile(GrammarSpec.json_schema({{"type": "object", "properties": {{"a": {{"type": "integer"}}}}}}))
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(Path(pagedllm.__file__).parents[1])})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
