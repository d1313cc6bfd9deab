"""ModelConfig from config.json (old and new key spellings) and from GGUF metadata."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model.config import ModelConfig
from pagedllm.model.errors import UnsupportedModelError

BASE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
    "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
}


def test_older_keys():
    config = ModelConfig.from_hf_config({
        **BASE, "num_key_value_heads": 2, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
        "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.dtype is torch.bfloat16
    assert (config.num_key_value_heads, config.head_dim) == (2, 8)


def test_newer_keys():
    config = ModelConfig.from_hf_config({
        **BASE, "dtype": "float16", "head_dim": 16,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0}})
    assert config.rope_theta == 500000.0 and config.rope_type == "llama3"
    # transformers fills original_max_position_embeddings from max_position_embeddings.
    assert config.rope_scaling["original_max_position_embeddings"] == 4096
    assert config.dtype is torch.float16 and config.head_dim == 16
    assert config.num_key_value_heads == 8  # MHA when not given


def test_defaults_and_plain_rope():
    config = ModelConfig.from_hf_config(
        {**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert config.rope_scaling is None and config.rope_type == "default"
    assert config.dtype is torch.float32 and not config.tie_word_embeddings
    assert not (config.attention_bias or config.output_bias or config.mlp_bias)


def test_eos_ids_merge_generation_config():
    config = ModelConfig.from_hf_config({**BASE, "eos_token_id": [2, 5]},
                                        {"eos_token_id": [5, 7]})
    assert config.eos_token_ids == [2, 5, 7]


def test_bias_flags_per_architecture():
    qwen2 = ModelConfig.from_hf_config({**BASE, "architectures": ["Qwen2ForCausalLM"],
                                        "use_sliding_window": False, "sliding_window": 4096})
    assert qwen2.attention_bias and not qwen2.output_bias and qwen2.sliding_window is None
    llama = ModelConfig.from_hf_config({**BASE, "attention_bias": True})
    assert llama.attention_bias and llama.output_bias
    mistral = ModelConfig.from_hf_config({**BASE, "architectures": ["MistralForCausalLM"],
                                          "sliding_window": None})
    assert mistral.sliding_window is None


@pytest.mark.parametrize("change, fragment", [
    ({"architectures": ["PhiForCausalLM"]}, "PhiForCausalLM"),
    ({"architectures": []}, "architecture"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
    ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
    ({"num_key_value_heads": 3}, "multiple"),
    ({"torch_dtype": "float64"}, "float64"),
])
def test_refused(change, fragment):
    with pytest.raises(UnsupportedModelError, match=fragment):
        ModelConfig.from_hf_config({**BASE, **change})


def test_from_gguf_metadata():
    metadata = {
        "general.architecture": "qwen2", "qwen2.block_count": 2, "qwen2.context_length": 32768,
        "qwen2.embedding_length": 64, "qwen2.feed_forward_length": 128,
        "qwen2.attention.head_count": 4, "qwen2.attention.head_count_kv": 2,
        "qwen2.rope.freq_base": 1e6, "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
        "tokenizer.ggml.tokens": ["a"] * 100, "tokenizer.ggml.bos_token_id": 5,
        "tokenizer.ggml.eos_token_id": 7, "tokenizer.ggml.eot_token_id": 8,
        "general.file_type": 1,
    }
    config = ModelConfig.from_gguf_metadata(metadata, {"token_embd.weight", "blk.0.attn_q.bias"})
    assert config.architecture == "Qwen2ForCausalLM" and config.vocab_size == 100
    assert config.tie_word_embeddings and config.attention_bias
    assert config.head_dim == 16 and config.rope_theta == 1e6
    assert config.eos_token_ids == [7, 8] and config.dtype is torch.float16
    with pytest.raises(UnsupportedModelError, match="gemma"):
        ModelConfig.from_gguf_metadata({**metadata, "general.architecture": "gemma"}, set())
