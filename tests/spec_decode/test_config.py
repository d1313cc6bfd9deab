"""speculative_config: vLLM's shape accepted, every bad value refused in one line naming it."""

from __future__ import annotations

import json

import pytest

from pagedllm.config import EngineConfig
from pagedllm.spec_decode import (
    MAX_SPECULATIVE_TOKENS,
    NgramProposer,
    SpeculativeConfig,
    SuffixProposer,
    check_draft_vocabulary,
    make_proposer,
)
from pagedllm.text.tokenizer import Tokenizer


def test_vllm_shapes_parse():
    ngram = SpeculativeConfig.parse(json.dumps(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 6}))
    assert (ngram.method, ngram.num_speculative_tokens, ngram.prompt_lookup_min, ngram.prompt_lookup_max) \
        == ("ngram", 4, 2, 6)
    assert isinstance(make_proposer(ngram), NgramProposer)
    suffix = SpeculativeConfig.parse({"method": "suffix", "suffix_decoding_max_tree_depth": 16,
                                      "suffix_decoding_min_token_prob": 0.2})
    assert suffix.num_speculative_tokens == 16  # vLLM's default: the tree's depth
    assert isinstance(make_proposer(suffix), SuffixProposer)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("null") is None  # off
    assert SpeculativeConfig.parse(ngram) is ngram
    assert "prompt lookup 2-6" in ngram.describe()


def test_prompt_lookup_defaults_follow_vllm():
    both_unset = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (both_unset.prompt_lookup_min, both_unset.prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_max": 7})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (7, 7)


def test_draft_model_needs_an_existing_path(tmp_path):
    path = tmp_path / "draft.gguf"
    path.write_bytes(b"")
    config = SpeculativeConfig.parse({"method": "draft_model", "model": str(path),
                                      "num_speculative_tokens": 3})
    assert config.model == str(path)
    with pytest.raises(ValueError, match="engine builds its proposer"):
        make_proposer(config)
    with pytest.raises(ValueError, match="needs \"model\""):
        SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="does not exist"):
        SpeculativeConfig.parse({"method": "draft_model", "model": str(tmp_path / "nope"),
                                 "num_speculative_tokens": 3})


@pytest.mark.parametrize("value, message", [
    ("{not json", "must be a JSON object"),
    ("[1, 2]", "must be a JSON object"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram, suffix, draft_model"),
    ({"num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer from 1"),
    ({"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1},
     f"from 1 to {MAX_SPECULATIVE_TOKENS}"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
     r"prompt_lookup_min \(4\) must not exceed prompt_lookup_max \(3\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 8},
     "'suffix_decoding_max_tree_depth' is not a setting of method 'ngram' "
     "\\(it applies to method 'suffix'\\)"),
    ({"method": "suffix", "num_speculative_tokens": 2, "lookahead": 3}, "no such key"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 1}, "suffix_decoding_max_tree_depth must be"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob must be"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "suffix_decoding_max_spec_factor must be"),
    ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests"),
])
def test_bad_values_are_refused_in_one_line(value, message):
    with pytest.raises(ValueError, match=message) as info:
        SpeculativeConfig.parse(value)
    assert "\n" not in str(info.value)


def test_engine_config_checks_the_field_and_takes_a_draft_model_on_one_process(tmp_path):
    assert EngineConfig().speculative_config is None
    with pytest.raises(ValueError, match="method must be one of"):
        EngineConfig(speculative_config={"method": "medusa"})
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert "speculative decoding: ngram" in config.describe_choices()
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"")
    draft_config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    assert EngineConfig(speculative_config=draft_config).speculative_method == "draft_model"
    with pytest.raises(ValueError, match="'draft_model' runs on one process"):
        EngineConfig(speculative_config=draft_config, tensor_parallel_size=2)


def _tokenizer(vocab: dict[str, int], eos: str = "</s>") -> Tokenizer:
    import tokenizers
    from tokenizers.models import WordLevel

    return Tokenizer(tokenizers.Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                     {"eos_token": eos, "bos_token": None})


def test_draft_vocabulary_must_match():
    vocab = {"<unk>": 0, "</s>": 1, "a": 2, "b": 3}
    check_draft_vocabulary(4, 4, _tokenizer(vocab), _tokenizer(dict(vocab)))
    with pytest.raises(ValueError, match="draft model has 5 logits, the target 4"):
        check_draft_vocabulary(4, 5, _tokenizer(vocab), _tokenizer(vocab))
    other = {"<unk>": 0, "</s>": 1, "a": 3, "b": 2}
    with pytest.raises(ValueError, match="tokenizer differs from the target's .*first at id 2"):
        check_draft_vocabulary(4, 4, _tokenizer(vocab), _tokenizer(other))
    with pytest.raises(ValueError, match="eos_token_id is 2, the target's 1"):
        check_draft_vocabulary(4, 4, _tokenizer(vocab), _tokenizer(vocab, eos="a"))


def test_null_leaves_the_engine_plain():
    from pagedllm.config import EngineConfig

    assert EngineConfig(speculative_config="null").speculative_config is None
    assert "speculat" not in " ".join(EngineConfig(speculative_config="null").describe_choices())
