"""A real uvicorn server on a free loopback port, its engine core in a process of its own as
`pagedllm serve` runs it, over the default model in float32, or a tiny random Llama (byte
tokenizer, 64 positions) for tests that need many fast requests or a server of their own (storms,
faults, fuzzing, limits). Faults are injected into the core process through its test hooks, an
extension the core is started with (tests/server/core_hooks.py, RunningServer.debug)."""

from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn

from pagedllm.config import EngineConfig
from pagedllm.engine.core_client import CoreProcess
from pagedllm.engine.messages import EngineCoreStats
from pagedllm.model.tokenizer_files import load_tokenizer
from pagedllm.server.app import build_app
from pagedllm.server.async_engine import AsyncEngine
from tests.conftest import requires_default_model, wait_until_healthy
from tests.server import core_hooks

MODEL_NAME = "smollm2-test"
API_KEY = "test-key-123"


def metric_value(base_url: str, name: str) -> float:
    """One value of the server's /metrics, by its name after 'pagedllm:'."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return float(re.search(rf"^pagedllm:{name} (\S+)$", text, re.M).group(1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HandlerCount:
    """The app, counting the HTTP requests whose handlers have not returned yet (read from the
    test's thread: a plain int, written only by the event loop's)."""

    def __init__(self, app) -> None:
        self.app = app
        self.running = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.running += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.running -= 1


class RunningServer:
    """`pagedllm serve` inside the test process, but for the core: the core is a real process
    (one torch thread: the tiny model's matmuls are too small to share), the API runs in a
    thread here, so tests can look at its AsyncEngine."""

    def __init__(self, config: EngineConfig, api_key: str | None = None,
                 async_engine_kwargs: dict | None = None, core_log: Path | None = None,
                 with_hooks: bool = True, extensions: tuple[str, ...] = (), **app_kwargs) -> None:
        """extensions: more core extensions than the test hooks (tests/server/scripted_core.py)."""
        self.core_log = open(core_log, "w") if core_log is not None else None
        self.core = CoreProcess(config, num_threads=1, stderr=self.core_log,
                                extensions=[*([core_hooks.EXTENSION] if with_hooks else []), *extensions])
        self.ready = ready = self.core.wait_ready()  # its description: the start-up line
        self.async_engine = AsyncEngine(self.core, load_tokenizer(ready.model_path),
                                        **(async_engine_kwargs or {}))
        self.app = build_app(self.async_engine, MODEL_NAME, api_key=api_key, **app_kwargs)
        self.hooks = core_hooks.HookClient()
        self.handlers = HandlerCount(self.app)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        uvicorn_config = uvicorn.Config(self.handlers, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(uvicorn_config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> RunningServer:
        self.thread.start()
        try:
            wait_until_healthy(self.base_url, 30, interval_s=0.05)
        except AssertionError:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        if self.thread.is_alive():  # closing the sockets under its event loop would crash libzmq
            raise AssertionError("the server thread did not stop within 30 s")
        self.core.close()
        self.hooks.close()
        if self.core_log is not None:
            self.core_log.close()

    def send_to_core(self, message) -> None:
        """Put a message on the channel to the core, from the event loop's thread (which owns the
        socket); msgspec.Raw(frame) sends a frame as it is."""
        self.async_engine._loop.call_soon_threadsafe(self.core.send, message)

    def debug(self, name: str, **args):
        """Run test hook `name` (tests/server/core_hooks.py) in the core, between two steps; its
        result."""
        return self.hooks.call(self.send_to_core, name, timeout_s=60, **args)

    def poison_ids(self, prompt: str) -> list[int]:
        return self.async_engine.input_processor.tokenizer.encode(prompt)

    def wait_idle(self, timeout_s: float = 30) -> EngineCoreStats:
        """Wait until the engine has nothing running or waiting; return its last figures."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats = self.async_engine.stats
            if not self.async_engine.has_unfinished_requests() and stats.num_running == 0 \
                    and stats.num_waiting == 0:
                return stats
            time.sleep(0.05)
        raise AssertionError(f"server still busy: {self.async_engine.stats}")


@pytest.fixture
def core_starts(monkeypatch) -> list[EngineConfig]:
    """The engine core processes something tried to start from now on, each refused (an
    AssertionError): for checks that bad settings stop `pagedllm serve` before any model load."""
    started: list[EngineConfig] = []

    def refuse(config: EngineConfig, *args, **kwargs):
        started.append(config)
        raise AssertionError("an engine core process was started")

    monkeypatch.setattr("pagedllm.engine.core_client.CoreProcess", refuse)
    return started


@pytest.fixture(scope="session")
def server_config():
    if requires_default_model.args[0]:
        pytest.skip(requires_default_model.kwargs["reason"])
    return EngineConfig(dtype="float32", kv_cache_memory="256MiB", max_model_len=1024,
                        enable_prefix_caching=False)


@pytest.fixture(scope="session")
def server(server_config):
    with RunningServer(server_config) as running:
        yield running


def tiny_config(model_dir: Path, **kwargs) -> EngineConfig:
    """The tiny model: float32, blocks of 16 (the budgets below are counted in them), max_model_len
    64; kwargs override."""
    return EngineConfig(**{"model": str(model_dir), "dtype": "float32", "num_kv_blocks": 64, "block_size": 16,
                           **kwargs})


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny model's matmuls are too small to share: on a busy machine, OpenMP threads
    spin-waiting for each other make a step many times slower than one thread. For the engines
    tests make in this process (the servers' cores take one thread each)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
