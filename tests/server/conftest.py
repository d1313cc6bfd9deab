"""A real uvicorn server on a free loopback port, running the default model in float32, and
a tiny random Llama (byte tokenizer, 64 positions) for tests that need many fast requests or
an engine of their own (storms, faults, fuzzing, limits)."""

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

from pagedllm.core_messages import EngineCoreStats
from pagedllm.engine import LLMEngine
from pagedllm.server.app import build_app
from pagedllm.server.async_engine import AsyncEngine
from tests.conftest import requires_default_model

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


class RunningServer:
    def __init__(self, engine: LLMEngine, api_key: str | None = None,
                 async_engine_kwargs: dict | None = None, **app_kwargs) -> None:
        self.async_engine = AsyncEngine(engine, **(async_engine_kwargs or {}))
        self.app = build_app(self.async_engine, MODEL_NAME, api_key=api_key, **app_kwargs)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("server did not start")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

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


@pytest.fixture(scope="session")
def server_engine():
    if requires_default_model.args[0]:
        pytest.skip(requires_default_model.kwargs["reason"])
    return LLMEngine(dtype="float32", kv_cache_memory="256MiB", max_model_len=1024,
                     enable_prefix_caching=False)


@pytest.fixture(scope="session")
def server(server_engine):
    with RunningServer(server_engine) as running:
        yield running


def tiny_engine(model_dir: Path, **kwargs) -> LLMEngine:
    """An engine over the tiny model: float32, max_model_len 64; kwargs override."""
    return LLMEngine(**{"model": str(model_dir), "dtype": "float32", "num_kv_blocks": 64, **kwargs})


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny model's matmuls are too small to share: on a busy machine, OpenMP threads
    spin-waiting for each other make a step many times slower than one thread. Module-scoped,
    and requested by the module-scoped servers, because an engine thread keeps the setting it
    started with."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
