"""The LoRA settings: flags (--lora-modules takes several name=path values), their checks, and
LoRARequest's."""

import argparse

import pytest

from pagedllm.config import EngineConfig, add_engine_args, engine_config_from_args
from pagedllm.lora.request import LoRARequest, parse_lora_modules


def test_the_lora_flags_make_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--enable-lora", "--lora-modules", "a=/x/a", "b=/y/b", "--max-loras", "4",
                              "--max-lora-rank", "32", "--max-cpu-loras", "8",
                              "--allow-runtime-lora-updating"])
    config = engine_config_from_args(args)
    assert config.enable_lora and config.allow_runtime_lora_updating
    assert config.lora_modules == ("a=/x/a", "b=/y/b")
    assert (config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (4, 32, 8)
    assert parse_lora_modules(config.lora_modules) == {"a": "/x/a", "b": "/y/b"}
    assert not engine_config_from_args(parser.parse_args([])).enable_lora


@pytest.mark.parametrize("kwargs,words", [
    (dict(lora_modules=("a=/x",)), "lora_modules needs enable_lora"),
    (dict(enable_lora=True, lora_modules=("a",)), "'a' is not name=path"),
    (dict(enable_lora=True, lora_modules=("a=/x", "a=/y")), "'a' is given twice"),
    (dict(enable_lora=True, max_loras=0), "max_loras must be a positive integer"),
    (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), "max_cpu_loras \\(2\\) must be at least"),
    (dict(enable_lora=True, tensor_parallel_size=2), "enable_lora runs on one process"),
    (dict(enable_lora=True, batch_invariant=True), "cannot be combined"),
])
def test_bad_lora_settings_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(**kwargs)


def test_a_lora_request_is_checked():
    request = LoRARequest("a", 1, "/x")
    assert request.key != LoRARequest("a", 2, "/x").key != LoRARequest("b", 1, "/x").key
    for bad, words in ((("", 1, "/x"), "lora_name"), (("a", 0, "/x"), "lora_int_id"),
                       (("a", True, "/x"), "lora_int_id"), (("a", 1, ""), "lora_path")):
        with pytest.raises(ValueError, match=words):
            LoRARequest(*bad)
