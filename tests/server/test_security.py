"""Security defaults: loopback unless told otherwise, the API key compared in constant time and
checked before any body is read, `model` can only name the served model (never a path), weights
only from safetensors or GGUF (never unpickled), chat templates sandboxed, no remote code."""

from __future__ import annotations

import hmac
import re
import shutil
from pathlib import Path

import httpx
import pytest

import pagedllm
from tests.server.conftest import API_KEY, MODEL_NAME, RunningServer, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PACKAGE = Path(pagedllm.__file__).parent


def test_serve_binds_to_loopback_by_default():
    from pagedllm.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1"
    assert args.api_key is None


@pytest.fixture(scope="module")
def secured_server(tiny_model_dir, one_torch_thread):
    with RunningServer(tiny_config(tiny_model_dir), api_key=API_KEY, max_body_bytes=4096) as running:
        yield running


def test_api_key_is_compared_in_constant_time(secured_server, monkeypatch):
    compared, real_compare = [], hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real_compare(a, b)

    monkeypatch.setattr("pagedllm.server.guard.hmac.compare_digest", spy)
    for given in ["Bearer nope", f"Bearer {API_KEY[:-1]}", f"Bearer {API_KEY}x", "", "Bearer ünï"]:
        headers = {"Authorization": given.encode()} if given else {}
        response = httpx.get(f"{secured_server.base_url}/v1/models", headers=headers)
        assert response.status_code == 401, given
        assert response.json()["error"]["type"] == "authentication_error"
    ok = httpx.get(f"{secured_server.base_url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200
    assert len(compared) == 6 and all(isinstance(a, bytes) for a, _ in compared)


def test_api_key_is_checked_before_the_body_is_read(secured_server):
    def endless():
        yield b'{"prompt": "'
        yield b"x" * 100_000  # more than the body limit: a 413 would mean it was read
        yield b'"}'

    response = httpx.post(f"{secured_server.base_url}/v1/completions", content=endless(),
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 401


@pytest.mark.parametrize("model", ["/etc/passwd", "../../model.gguf", "smollm2-test/../x",
                                   "HuggingFaceTB/SmolLM2-135M-Instruct", "file:///tmp/x.gguf", ""])
def test_model_field_only_names_the_served_model(secured_server, model, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a request tried to load a model")

    monkeypatch.setattr("pagedllm.model.loader.load_model", no_loading)
    monkeypatch.setattr("pagedllm.distributed.driver.load_model", no_loading)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    response = httpx.post(f"{secured_server.base_url}/v1/completions", headers=headers,
                          json={"model": model, "prompt": "hi", "max_tokens": 2})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    served = httpx.post(f"{secured_server.base_url}/v1/completions", headers=headers,
                        json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
    assert served.status_code == 200


def test_served_model_path_is_not_a_model_name(secured_server):
    path = str(secured_server.async_engine.model_path)
    response = httpx.post(f"{secured_server.base_url}/v1/chat/completions",
                          headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": path, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 404


def _source_files():
    return [p for p in PACKAGE.rglob("*.py") if p.is_file()]


@pytest.mark.parametrize("pattern,why", [
    (r"\btorch\.load\(", "torch.load unpickles"),
    (r"^\s*(import|from) (pickle|dill|joblib|marshal|cloudpickle)\b", "unpickling"),
    (r"allow_pickle\s*=\s*True", "numpy unpickling"),
    (r"trust_remote_code\s*=\s*True", "remote code"),
    (r"(?<![.\w])(eval|exec)\(", "evaluating text as code"),
    (r"jinja2\.Environment\(|from jinja2 import .*\bEnvironment\b", "an unsandboxed template"),
])
def test_no_unpickling_or_remote_code_in_the_package(pattern, why):
    offenders = []
    for path in _source_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(pattern, line):
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not offenders, f"{why}: {offenders}"


def test_pickled_weights_are_refused(tiny_model_dir, tmp_path):
    from pagedllm.model.errors import ModelLoadError
    from pagedllm.model.loader import load_model

    folder = tmp_path / "pickled"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ModelLoadError, match="pickle"):
        load_model(folder, dtype="float32")
