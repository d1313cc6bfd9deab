"""The model's generation_config.json sampling defaults: read as --generation-config says, applied to
requests that set nothing, never over what a request sets."""

from __future__ import annotations

import json
import shutil

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.text.generation_defaults import read_generation_defaults

GENERATION_CONFIG = {"eos_token_id": [257, 299], "temperature": 0.6, "top_p": 0.9, "top_k": 0,
                     "do_sample": True, "max_new_tokens": 7, "repetition_penalty": None}


def write(folder, config) -> None:
    (folder / "generation_config.json").write_text(json.dumps(config))


def test_auto_reads_the_sampling_fields_of_the_models_file(tmp_path):
    write(tmp_path, GENERATION_CONFIG)
    # max_new_tokens is SamplingParams' max_tokens (vLLM's default for a request that gives none)
    assert read_generation_defaults("auto", tmp_path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 0,
                                                          "max_tokens": 7}
    assert read_generation_defaults("auto", tmp_path / "model.gguf") == {}  # a GGUF file: none
    assert read_generation_defaults("auto", tmp_path / "elsewhere") == {}


def test_vllm_or_none_turns_them_off_and_a_folder_replaces_the_models(tmp_path):
    write(tmp_path, GENERATION_CONFIG)
    other = tmp_path / "other"
    other.mkdir()
    write(other, {"min_p": 0.1})
    for off in ("vllm", "none"):
        assert read_generation_defaults(off, tmp_path) == {}
    assert read_generation_defaults(str(other), tmp_path) == {"min_p": 0.1}
    with pytest.raises(ValueError, match="no generation_config.json in that folder"):
        read_generation_defaults(str(tmp_path / "missing"), tmp_path)


@pytest.mark.parametrize("content,words", [
    ("{oops", "not valid JSON"), ("[1]", "JSON object"),
    (json.dumps({"temperature": -1}), "temperature must be"),
])
def test_a_bad_file_is_refused_naming_it(tmp_path, content, words):
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=words) as caught:
        read_generation_defaults("auto", tmp_path)
    assert "generation_config.json" in str(caught.value)


@pytest.fixture(scope="module")
def greedy_by_default_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a generation_config.json that makes unset sampling greedy (top_k 1)."""
    folder = tmp_path_factory.mktemp("greedy-default")
    for item in tiny_model_dir.iterdir():
        shutil.copy(item, folder / item.name)
    write(folder, {"top_k": 1, "temperature": 1.0})
    return folder


def test_defaults_apply_where_the_caller_gives_no_params(greedy_by_default_dir):
    llm = LLM(str(greedy_by_default_dir), dtype="float32", num_kv_blocks=64)
    assert llm.get_default_sampling_params() == SamplingParams(top_k=1, temperature=1.0)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    defaulted = llm.generate([prompt] * 3, use_tqdm=False)  # top_k 1: the greedy tokens
    assert {tuple(o.outputs[0].token_ids) for o in defaulted} == {tuple(greedy[0].outputs[0].token_ids)}
    # Given params are the caller's, whole: sampled from all tokens with their seeds.
    sampled = llm.generate([prompt] * 3, [SamplingParams(seed=s, max_tokens=16) for s in range(3)],
                           use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in sampled}) > 1
    off = LLM(str(greedy_by_default_dir), dtype="float32", num_kv_blocks=64, generation_config="none")
    assert off.get_default_sampling_params() == SamplingParams()
