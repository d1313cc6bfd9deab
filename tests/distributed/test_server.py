"""The server with tensor parallelism: `pagedllm serve --tensor-parallel-size 2` answers as the
offline engine at size 1 does, its worker dies with it (even when it is killed), and a worker
that dies turns into failed requests and then a dead engine: 503s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import psutil
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from tests.conftest import wait_until_healthy
from tests.model.tiny import make_hf_model, save_checkpoint
from tests.server.conftest import MODEL_NAME, RunningServer, free_port

PROMPT = "hello world"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_checkpoint(make_hf_model("llama_gqa_untied"), tmp_path_factory.mktemp("tiny"))


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def complete(base_url: str) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True})


def workers_of(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True)
            if "pagedllm.distributed.worker" in " ".join(p.cmdline())]


def test_serve_with_tensor_parallel_size_two(model_dir):
    expected = LLM(str(model_dir), dtype="float32", num_kv_blocks=64).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.cli", "serve", "--model", str(model_dir), "--port", str(port),
         "--dtype", "float32", "--kv-cache-memory", "1MiB", "--tensor-parallel-size", "2",
         "--served-model-name", MODEL_NAME],
        env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_until_healthy(base_url, 120,
                           lambda: None if server.poll() is None else f"exit code {server.returncode}")
        (worker,) = workers_of(server.pid)
        response = complete(base_url)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected[0].outputs[0].text
        server.send_signal(signal.SIGKILL)  # no clean-up runs: the kernel ends the worker
        server.wait(timeout=10)
        worker.wait(timeout=10)
    finally:
        if server.poll() is None:
            server.kill()


def test_a_dead_worker_makes_the_server_say_503(model_dir):
    # The collective timeout well under the client's 60 s: gloo usually sees the dead peer at once,
    # but beside a parallel suite's other work it once waited for the timeout (120 s by default).
    config = EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2,
                          distributed_timeout_s=15)
    with RunningServer(config) as running:
        assert complete(running.base_url).status_code == 200
        (worker,) = workers_of(running.core.pid)  # the core process started it
        worker.kill()
        statuses = [complete(running.base_url).status_code for _ in range(4)]
        assert statuses[0] == 500 and statuses[-1] == 503, statuses
        health = httpx.get(f"{running.base_url}/health", timeout=10)
        assert health.status_code == 503 and "tensor parallel" in health.text
