"""Issue 24's small server items, each failing before its fix: no traceback when a client of a
non-streamed request goes away, the API key from a file or the environment and never empty,
client strings echoed only in part, the Host header checked (DNS rebinding), 405s typed as the
client's error, and streams cut by a shutdown told so in an error event."""

from __future__ import annotations

import gc
import json
import logging
import threading
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from pagedllm.server.hosts import LOOPBACK_HOSTS, allowed_hosts_for
from pagedllm.server.keys import API_KEY_ENV, VLLM_API_KEY_ENV, read_api_key
from tests.conftest import wait_for
from tests.server.conftest import RunningServer, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@contextmanager
def slow_steps(server: RunningServer, step_s: float):
    """Each model step (in the core process) takes at least step_s, so requests last long enough
    to be cut."""
    server.debug("slow_steps", seconds=step_s)
    try:
        yield
    finally:
        server.debug("restore")


@pytest.fixture(scope="module")
def hygiene_config(tiny_model_dir):
    return tiny_config(tiny_model_dir)


@pytest.fixture(scope="module")
def hygiene_server(hygiene_config):
    with RunningServer(hygiene_config, allowed_hosts=LOOPBACK_HOSTS) as running:
        yield running


# -- disconnects ----------------------------------------------------------------------------------

def test_client_leaving_a_non_streamed_request_logs_no_traceback(hygiene_server, caplog):
    with caplog.at_level(logging.ERROR), slow_steps(hygiene_server, 0.05):
        for _ in range(3):
            with pytest.raises(httpx.TimeoutException):
                httpx.post(f"{hygiene_server.base_url}/v1/completions", timeout=0.3,
                           json={"prompt": "hello", "max_tokens": 40, "ignore_eos": True})
        hygiene_server.wait_idle()
        wait_for(lambda: hygiene_server.handlers.running == 0,  # they end once the disconnect is seen
                 "the handlers of the requests whose clients left to end")
        gc.collect()
    assert "never retrieved" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


# -- API key --------------------------------------------------------------------------------------

def test_api_key_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(VLLM_API_KEY_ENV, raising=False)
    assert read_api_key(None, None) is None
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    assert read_api_key(None, str(key_file)) == "s3cret"
    monkeypatch.setenv(VLLM_API_KEY_ENV, "from-vllm")
    assert read_api_key(None, None) == "from-vllm"
    monkeypatch.setenv(API_KEY_ENV, "from-pagedllm")
    assert read_api_key(None, None) == "from-pagedllm"
    assert read_api_key("flag", None) == "flag"


@pytest.mark.parametrize("flags,env", [(["--api-key", ""], {}), (["--api-key", "  "], {}),
                                       ([], {API_KEY_ENV: ""}), (["--api-key-file", "EMPTY"], {}),
                                       (["--api-key", "a", "--api-key-file", "EMPTY"], {})])
def test_empty_or_doubled_api_key_stops_start_up(flags, env, tmp_path, monkeypatch, capsys, core_starts):
    from pagedllm.cli import main

    empty = tmp_path / "empty"
    empty.write_text("\n")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    flags = [str(empty) if flag == "EMPTY" else flag for flag in flags]
    assert main(["serve", "--model", "/nowhere/at/all", *flags]) == 2
    err = capsys.readouterr().err
    assert "empty" in err or "not both" in err, err
    assert core_starts == []  # refused before any model load


# -- echoes, hosts, error types -------------------------------------------------------------------

def test_a_huge_model_name_is_not_echoed_whole(hygiene_server):
    response = httpx.post(f"{hygiene_server.base_url}/v1/completions", timeout=30,
                          json={"model": "m" * 3_000_000, "prompt": "hi"})
    assert response.status_code == 404
    assert len(response.json()["error"]["message"]) < 400


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example",
                                  "localhost.evil.example"])
def test_other_host_headers_are_refused(hygiene_server, host):
    response = httpx.get(f"{hygiene_server.base_url}/v1/models", headers={"Host": host})
    assert response.status_code == 421
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("host", ["localhost", "localhost:1234", "127.0.0.1:8000", "[::1]:80", "LOCALHOST"])
def test_loopback_host_headers_are_served(hygiene_server, host):
    assert httpx.get(f"{hygiene_server.base_url}/v1/models", headers={"Host": host}).status_code == 200


def test_allowed_hosts_default_only_for_loopback_binds():
    assert allowed_hosts_for("127.0.0.1", None) == LOOPBACK_HOSTS
    assert allowed_hosts_for("::1", None) == LOOPBACK_HOSTS
    assert allowed_hosts_for("localhost", None) == LOOPBACK_HOSTS
    assert allowed_hosts_for("0.0.0.0", None) is None
    assert allowed_hosts_for("127.0.0.1", None, unix_socket=True) is None  # no browser reaches it
    assert allowed_hosts_for("127.0.0.1", ["a.example"], unix_socket=True) == ("a.example",)
    assert allowed_hosts_for("127.0.0.1", ["*"]) is None
    assert allowed_hosts_for("0.0.0.0", ["api.example:443", "Other.Example"]) == ("api.example",
                                                                                  "other.example")


def test_405_is_the_clients_error(hygiene_server):
    response = httpx.get(f"{hygiene_server.base_url}/v1/completions")
    assert response.status_code == 405
    assert response.json()["error"]["type"] == "invalid_request_error"


# -- shutdown -------------------------------------------------------------------------------------

def test_stream_cut_at_the_shutdown_grace_limit_gets_an_error_event(hygiene_config):
    running = RunningServer(hygiene_config)
    config = uvicorn.Config(running.app, host="127.0.0.1", port=running.port, log_level="warning",
                            timeout_graceful_shutdown=0.5)
    running.server = uvicorn.Server(config)
    running.thread = threading.Thread(target=running.server.run, daemon=True)
    events: list[str] = []
    with running:
        running.debug("slow_steps", seconds=0.1)  # the core goes with the server: no restore

        def stream() -> None:
            body = {"prompt": "hello", "max_tokens": 50, "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", f"{running.base_url}/v1/completions", json=body, timeout=30) as r:
                    events.extend(line for line in r.iter_lines() if line.startswith("data:"))
            except httpx.RemoteProtocolError:  # uvicorn may close at the grace limit mid-chunk
                pass

        client = threading.Thread(target=stream)
        client.start()
        wait_for(lambda: len(events) >= 2 or not client.is_alive(), "the stream's first two events")
        assert len(events) >= 2, f"the stream ended before it had begun: {events}"
        running.server.should_exit = True  # what SIGTERM does
        client.join(timeout=30)
    assert len(events) < 50  # cut, not finished
    last = events[-1].removeprefix("data: ")
    error = json.loads(last)["error"] if last != "[DONE]" else json.loads(events[-2][6:])["error"]
    assert "shutting down" in error["message"]
