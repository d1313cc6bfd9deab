"""A core that stops answering fails /health (issue 32, finding 8: with the core stopped by
SIGSTOP, /health stayed 200), and passes again once it answers."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from tests.conftest import wait_for
from tests.server.conftest import RunningServer, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_stopped_core_fails_health_and_a_resumed_one_passes(tiny_model_dir):
    with RunningServer(tiny_config(tiny_model_dir), async_engine_kwargs={"stall_s": 1.0}) as server:
        assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
        os.kill(server.core.process.pid, signal.SIGSTOP)
        try:
            response = httpx.get(f"{server.base_url}/health", timeout=30)
            assert response.status_code == 503
            assert "has not answered for 1 s" in response.json()["error"]["message"]
        finally:
            os.kill(server.core.process.pid, signal.SIGCONT)
        wait_for(lambda: httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200,
                 "health after SIGCONT")
        ok = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                        timeout=60)
        assert ok.status_code == 200
