"""One client cannot freeze the others (issue 24's probe): a hostile body inside the size limit
(250k chat messages, 1.9M token ids) is refused by cheap bounds before the schema, templates or
tokenizer see it, and a chat template that loops is cut by its budget in a worker thread, while
other streams and /health go on. Checked as events (what refused a body, what was answered while
the template rendered), never as durations: the machine may be shared."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from pagedllm.server.limits import RequestPrecheck
from pagedllm.server.protocol import DEFAULT_MAX_BODY_BYTES
from pagedllm.text import tokenizer as tokenizer_module
from tests.conftest import wait_for
from tests.server.conftest import RunningServer, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Loops for hours on any conversation of more than one message (the one-message start-up check
# passes): only its budget stops it.
LOOPING_TEMPLATE = ("{% if messages|length > 1 %}{% for i in range(100000) %}"
                    "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}"
                    "{% for m in messages %}{{ m['content'] }}{% endfor %}")


@pytest.fixture(scope="module")
def hostile_server(tiny_model_dir, one_torch_thread):
    with RunningServer(tiny_config(tiny_model_dir), chat_template=LOOPING_TEMPLATE) as running:
        yield running


def _compact(body: dict) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    assert len(data) <= DEFAULT_MAX_BODY_BYTES
    return data


def hostile_bodies() -> list[tuple[str, bytes]]:
    """The probe's bodies, each just inside the 4 MiB limit."""
    messages = [{"role": "user"}] * 250_000
    return [("/v1/chat/completions", _compact({"messages": messages})),
            ("/v1/completions", _compact({"prompt": [1] * 1_900_000})),
            ("/v1/completions", _compact({"prompt": [[1] * 30_000] * 60})),
            ("/tokenize", _compact({"messages": messages}))]


class StreamWatch:
    """Streams completions one after another in a thread, counting their events."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.events = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"prompt": "hello", "max_tokens": 50, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                with client.stream("POST", f"{self.base_url}/v1/completions", json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data:"):
                            self.events += 1

    def __enter__(self) -> StreamWatch:
        self.thread.start()
        # streaming before the hostile part starts
        wait_for(lambda: self.events >= 5 or not self.thread.is_alive(), "the first five stream events")
        assert self.events >= 5, "the watching stream stopped before it had begun"
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def test_hostile_bodies_do_not_stall_other_streams(hostile_server, monkeypatch):
    """Each body is refused by the precheck (in a worker thread, before the schema, templates or
    tokenizer: the guard answers without calling the routes), and the other stream's events go
    on arriving while the bodies are handled."""
    refused = []
    real_check = RequestPrecheck._check

    def check(self, body: bytes):
        error = real_check(self, body)
        if error is not None:
            refused.append(len(body))
        return error

    monkeypatch.setattr(RequestPrecheck, "_check", check)
    bodies = hostile_bodies()  # made first: json.dumps holds the GIL this process shares
    events_while_handled = 0
    with StreamWatch(hostile_server.base_url) as watch:
        with httpx.Client(timeout=60) as client:
            for _ in range(2):  # back to back
                for path, body in bodies:
                    before = watch.events
                    response = client.post(f"{hostile_server.base_url}{path}", content=body,
                                           headers={"Content-Type": "application/json"})
                    events_while_handled += watch.events - before
                    assert response.status_code == 400, response.text[:300]
                    assert "maximum context length" in response.json()["error"]["message"]
    assert refused == [len(body) for _, body in bodies] * 2
    assert events_while_handled > 0, "the other stream got nothing while the bodies were handled"
    assert watch.events > 50


def test_body_with_too_many_values_is_refused_before_the_schema(hostile_server):
    # (a list the sampling bounds name, like allowed_token_ids, is refused by its length first)
    body = _compact({"prompt": "hi", "metadata": [1] * 1_000_000})
    response = httpx.post(f"{hostile_server.base_url}/v1/completions", content=body,
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400
    assert "JSON values" in response.json()["error"]["message"]
    body = _compact({"prompt": "hi", "allowed_token_ids": [1] * 1_000_000})
    response = httpx.post(f"{hostile_server.base_url}/v1/completions", content=body,
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "allowed_token_ids"


def test_looping_template_is_cut_and_health_stays_up(hostile_server, monkeypatch):
    result: dict = {}

    def chat() -> None:
        messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "c"}]
        result["response"] = httpx.post(f"{hostile_server.base_url}/v1/chat/completions",
                                        json={"messages": messages, "max_tokens": 2}, timeout=60)

    rendering = threading.Event()  # set while the looping conversation renders
    real_render = tokenizer_module.render_chat_template

    def render(compiled, **kwargs):
        if len(kwargs["messages"]) == 1:
            return real_render(compiled, **kwargs)
        rendering.set()
        try:
            return real_render(compiled, **kwargs)
        finally:
            rendering.clear()

    monkeypatch.setattr(tokenizer_module, "render_chat_template", render)
    thread = threading.Thread(target=chat)
    thread.start()
    health_while_rendering = 0
    while thread.is_alive():
        assert httpx.get(f"{hostile_server.base_url}/health", timeout=10).status_code == 200
        health_while_rendering += rendering.is_set()  # answered while the template still ran
        time.sleep(0.05)
    thread.join()
    response = result["response"]
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "chat_template_timeout"
    assert "chat template" in error["message"] and "not this request" in error["message"]
    assert health_while_rendering > 0, "/health was not answered while the template rendered"
    one = httpx.post(f"{hostile_server.base_url}/v1/chat/completions", timeout=30,
                     json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert one.status_code == 200, one.text
