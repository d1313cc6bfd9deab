"""Faults: a model step that raises fails the request that makes it fail (found by running each
alone; the others run again without it and get their solo text) or, where none can be pinned, the
requests of that step (the client sees an error, the cause is logged, their blocks go back), and
the server goes on; an engine that keeps failing
is marked dead and /health says 503; a damaged model file stops `pagedllm serve` at start with
a clear message."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager

import httpx
import pytest

from pagedllm.engine.core_process import MAX_CONSECUTIVE_STEP_FAILURES
from tests.conftest import await_for
from tests.server.conftest import RunningServer, free_port, metric_value, tiny_config
from tests.server.core_hooks import POISON

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NORMAL = "A normal request"


@contextmanager
def failing_steps(server: RunningServer, when: str, **args):
    """Make the core's model step raise InjectedFault (see core_hooks.fail_steps); yields the
    number of failed steps, filled in when the context ends."""
    calls = {}
    server.debug("fail_steps", when=when, poison_ids=server.poison_ids(POISON), **args)
    try:
        yield calls
    finally:
        calls.update(server.debug("restore"))


@pytest.fixture(scope="module")
def fault_server(tiny_model_dir, one_torch_thread, tmp_path_factory):
    core_log = tmp_path_factory.mktemp("fault-core") / "core.log"
    with RunningServer(tiny_config(tiny_model_dir, num_kv_blocks=32), core_log=core_log) as running:
        yield running


def complete(server, prompt: str, **fields) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, **fields}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)


def assert_all_blocks_free(server) -> None:
    snap = server.wait_idle()
    assert snap.kv.num_used_blocks == 0 and snap.kv.num_free_blocks == snap.kv.num_blocks
    assert not server.async_engine._streams


def test_failed_step_fails_its_request_and_the_server_goes_on(fault_server):
    solo = complete(fault_server, NORMAL).json()["choices"][0]["text"]
    with failing_steps(fault_server, "poison") as calls:
        response = complete(fault_server, POISON + " non-streamed")
    assert calls["failed"] == 1
    assert response.status_code == 500
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error" and "injected fault" in error["message"]
    core_log = fault_server.core_log.name
    assert "InjectedFault: injected fault in the model step" in open(core_log).read()  # the cause, logged
    assert_all_blocks_free(fault_server)
    assert httpx.get(f"{fault_server.base_url}/health").status_code == 200
    after = complete(fault_server, NORMAL)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == solo


def test_a_failing_request_fails_alone_and_the_others_in_its_steps_go_on(fault_server):
    solo = complete(fault_server, NORMAL, max_tokens=40, ignore_eos=True).json()["choices"][0]["text"]

    async def both():
        async with httpx.AsyncClient(base_url=fault_server.base_url, timeout=60) as client:
            normal = asyncio.ensure_future(client.post("/v1/completions", json={
                "prompt": NORMAL, "max_tokens": 40, "ignore_eos": True, "temperature": 0}))
            await await_for(lambda: fault_server.async_engine.stats.num_running >= 1,
                            "the normal request to run")
            poisoned = await client.post("/v1/completions", json={
                "prompt": POISON, "max_tokens": 8, "temperature": 0})
            return poisoned, await normal

    with failing_steps(fault_server, "poison", delay_s=0.02) as calls:
        poisoned, normal = asyncio.run(both())
    assert calls["failed"] >= 2  # the shared step, then the poisoned request's lone run
    assert poisoned.status_code == 500 and "injected fault" in poisoned.json()["error"]["message"]
    assert normal.status_code == 200 and normal.json()["choices"][0]["text"] == solo
    assert fault_server.async_engine.healthy
    assert_all_blocks_free(fault_server)
    assert metric_value(fault_server.base_url, "engine_failed_requests_total") >= 1


def test_failed_step_mid_stream_sends_an_error_event(fault_server):
    # Fail on the request's 3rd step, after some tokens have gone out (one or a decode burst's a step).
    with failing_steps(fault_server, "nth", nth=3), httpx.stream(
            "POST", f"{fault_server.base_url}/v1/completions", timeout=60,
            json={"prompt": NORMAL, "max_tokens": 20, "temperature": 0, "stream": True,
                  "ignore_eos": True}) as response:
        assert response.status_code == 200
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert any(c.get("choices") and c["choices"][0]["text"] for c in chunks)  # tokens came first
    assert "injected fault" in chunks[-1]["error"]["message"]
    assert_all_blocks_free(fault_server)


def test_only_the_failing_steps_requests_fail(tiny_model_dir):
    """One request per step: the poisoned request fails while another waits in the scheduler's
    queue behind it; the waiting one is untouched, runs next and gets its solo text."""
    with RunningServer(tiny_config(tiny_model_dir, num_kv_blocks=32, max_num_seqs=1)) as server:
        solo = complete(server, NORMAL, max_tokens=12).json()["choices"][0]["text"]

        async def both():
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
                poisoned = asyncio.ensure_future(client.post("/v1/completions", json={
                    "prompt": POISON, "max_tokens": 50, "ignore_eos": True, "temperature": 0}))
                await await_for(lambda: server.async_engine.stats.num_running >= 1,
                                "the poisoned request to run")
                normal = await client.post(
                    "/v1/completions", json={"prompt": NORMAL, "max_tokens": 12, "temperature": 0})
                return await poisoned, normal

        with failing_steps(server, "poison_while_another_waits") as calls:
            poisoned, normal = asyncio.run(both())
        assert calls["failed"] == 1
        assert poisoned.status_code == 500
        assert normal.status_code == 200 and normal.json()["choices"][0]["text"] == solo
        assert server.async_engine.healthy
        assert_all_blocks_free(server)


def test_engine_that_keeps_failing_is_dead_and_health_says_503(tiny_model_dir):
    with RunningServer(tiny_config(tiny_model_dir, num_kv_blocks=32, max_num_seqs=1)) as server:
        async def many():
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
                return await asyncio.gather(*(client.post(
                    "/v1/completions", json={"prompt": f"{NORMAL} {i}", "max_tokens": 4})
                    for i in range(2 * MAX_CONSECUTIVE_STEP_FAILURES)))

        server.debug("fail_steps", when="always")
        responses = asyncio.run(many())
        # Every client got an answer (none hangs): 500 for a failed step, 503 once dead.
        assert sorted({r.status_code for r in responses}) == [500, 503]
        assert sum(r.status_code == 500 for r in responses) == MAX_CONSECUTIVE_STEP_FAILURES
        assert all(set(r.json()["error"]) == {"message", "type", "param", "code"} for r in responses)
        health = httpx.get(f"{server.base_url}/health")
        assert health.status_code == 503 and health.headers["retry-after"]
        assert "failed 3 steps in a row" in health.json()["error"]["message"]
        refused = complete(server, NORMAL)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        # The core gave up and exited; nothing is left waiting in the API process.
        assert server.core.wait_exit(30) == 1
        assert not server.async_engine.has_unfinished_requests() and not server.async_engine._streams


# -- a damaged model file stops `pagedllm serve` at start -----------------------------------------

@pytest.fixture
def damaged_models(tiny_model_dir, tmp_path):
    from tests.model.tiny import make_hf_model, write_gguf

    truncated_folder = tmp_path / "truncated-safetensors"
    shutil.copytree(tiny_model_dir, truncated_folder)
    weights = truncated_folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    gguf_file = write_gguf(make_hf_model("llama_gqa_untied"), tmp_path / "tiny.gguf")
    os.truncate(gguf_file, gguf_file.stat().st_size * 2 // 3)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a model" * 100)
    return {"safetensors": (truncated_folder, "truncated"), "gguf": (gguf_file, "truncated"),
            "garbage": (garbage, "GGUF")}


@pytest.mark.parametrize("kind", ["safetensors", "gguf", "garbage"])
def test_damaged_model_fails_serve_at_start(damaged_models, kind, capsys):
    from pagedllm.cli import main

    path, words = damaged_models[kind]
    port = free_port()
    code = main(["serve", "--model", str(path), "--port", str(port), "--dtype", "float32"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("pagedllm: error: ") and str(path) in err and words in err, err
    with pytest.raises(httpx.ConnectError):  # it never started listening
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)


def test_damaged_model_as_a_real_process(damaged_models):
    """The same through the installed entry point: exit status 2, one clear line, no traceback."""
    path, words = damaged_models["gguf"]
    done = subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", "--model", str(path),
                           "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "pagedllm: error: " in done.stderr and words in done.stderr, done.stderr


def test_bad_serve_flags_fail_before_loading(capsys, core_starts):
    from pagedllm.cli import main

    for flags in (["--max-waiting-requests", "0"], ["--max-body-bytes", "0"]):
        assert main(["serve", "--model", "/nowhere/at/all", *flags]) == 2
        assert "must be" in capsys.readouterr().err
    assert core_starts == []
