"""`pagedllm generate | chat`: the sampling flags left unset leave the model's generation_config.json
(and then the library's defaults) in charge, as a request to LLM.generate or the server does."""

import json
import shutil

import pytest

from pagedllm.cli import main
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_with_defaults(tiny_model_dir, tmp_path_factory):
    """The tiny model with a generation_config.json that sets temperature, top_p and top_k."""
    folder = tmp_path_factory.mktemp("cli-model")
    for item in tiny_model_dir.iterdir():
        shutil.copy(item, folder / item.name)
    (folder / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.3, "top_p": 0.9, "top_k": 5}))
    return folder


@pytest.fixture
def requests_seen(monkeypatch) -> list[SamplingParams]:
    """The SamplingParams of every request the engine is given."""
    seen = []
    original = LLMEngine.add_request

    def recording(self, request_id, prompt, sampling_params=None, **kwargs):
        seen.append(sampling_params)
        return original(self, request_id, prompt, sampling_params, **kwargs)

    monkeypatch.setattr(LLMEngine, "add_request", recording)
    return seen


def _generate(model, *flags):
    return main(["generate", "Hello", "--model", str(model), "--dtype", "float32", "--num-kv-blocks", "16",
                 "--block-size", "16", *flags])


def test_generate_takes_the_models_sampling_defaults(model_with_defaults, requests_seen, capsys):
    assert _generate(model_with_defaults) == 0
    (params,) = requests_seen
    assert (params.temperature, params.top_p, params.top_k) == (0.3, 0.9, 5)
    assert params.max_tokens == SamplingParams().max_tokens == 16  # LLM.generate's, vLLM's
    assert params.seed is None
    assert capsys.readouterr().out.strip()


def test_a_sampling_flag_overrides_only_its_own_field(model_with_defaults, requests_seen):
    assert _generate(model_with_defaults, "--temperature", "0", "--max-tokens", "4",
                     "--sampling-seed", "9", "--seed", "3") == 0
    (params,) = requests_seen
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.9, 5)
    assert (params.max_tokens, params.seed) == (4, 9)


def test_generation_config_none_leaves_the_librarys_defaults(model_with_defaults, requests_seen):
    assert _generate(model_with_defaults, "--generation-config", "none", "--max-tokens", "2") == 0
    (params,) = requests_seen
    assert params == SamplingParams(max_tokens=2, output_kind=params.output_kind)


def test_a_bad_sampling_flag_fails_in_one_line(model_with_defaults, capsys):
    assert _generate(model_with_defaults, "--top-p", "1.5") == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedllm: error: ") and "top_p" in err


def test_chat_takes_the_models_defaults_and_replies_until_it_ends(model_with_defaults, requests_seen,
                                                                   monkeypatch):
    lines = iter(["Hi there"])

    def one_line(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", one_line)
    assert main(["chat", "--model", str(model_with_defaults), "--dtype", "float32", "--num-kv-blocks", "16",
                 "--block-size", "16", "--max-model-len", "64", "--top-k", "2"]) == 0
    (params,) = requests_seen
    assert (params.temperature, params.top_p, params.top_k) == (0.3, 0.9, 2)
    assert params.max_tokens is None  # as /v1/chat/completions: until the reply ends
