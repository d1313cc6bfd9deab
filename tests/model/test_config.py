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


def test_gemma3_older_keys():
    # Released Gemma 3 configs: rope_local_base_freq and sliding_window_pattern, no layer_types.
    config = ModelConfig.from_hf_config({
        **BASE, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 12,
        "head_dim": 32, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512,
        "sliding_window_pattern": 6, "query_pre_attn_scalar": 32,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu"})
    assert config.sliding_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
    assert [config.uses_local_rope(i) for i in (4, 5)] == [True, False]
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.hidden_act == "gelu_pytorch_tanh" and config.query_pre_attn_scalar == 32
    # Without the local base, transformers' default for it.
    assert ModelConfig.from_hf_config(
        {**BASE, "architectures": ["Gemma3ForCausalLM"]}).local_rope_theta == 1e4


def test_sliding_layers_per_family():
    gemma2 = ModelConfig.from_hf_config({**BASE, "architectures": ["Gemma2ForCausalLM"],
                                         "num_hidden_layers": 4, "sliding_window": 4096})
    assert gemma2.sliding_layers == (0, 2)
    assert gemma2.uses_sliding_window(2) and not gemma2.uses_sliding_window(3)
    qwen3 = ModelConfig.from_hf_config({**BASE, "architectures": ["Qwen3ForCausalLM"],
                                        "use_sliding_window": True, "sliding_window": 64,
                                        "max_window_layers": 1})
    assert qwen3.sliding_layers == (1,) and not qwen3.attention_bias
    listed = ModelConfig.from_hf_config({
        **BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 8,
        "layer_types": ["full_attention", "sliding_attention"]})
    assert listed.sliding_layers == (1,)
    phi3 = ModelConfig.from_hf_config({**BASE, "architectures": ["Phi3ForCausalLM"],
                                       "sliding_window": 2047})
    assert phi3.sliding_layers is None and phi3.uses_sliding_window(1)
    # transformers' Llama has no window, whatever its config.json says.
    assert ModelConfig.from_hf_config({**BASE, "sliding_window": 8}).sliding_window is None


def test_phi3_longrope_older_keys():
    config = ModelConfig.from_hf_config({
        **BASE, "architectures": ["Phi3ForCausalLM"], "original_max_position_embeddings": 1024,
        "partial_rotary_factor": 0.75,
        "rope_scaling": {"type": "su", "short_factor": [1.0] * 3, "long_factor": [2.0] * 3}})
    assert config.rope_type == "longrope"
    assert config.rope_scaling["original_max_position_embeddings"] == 1024
    assert config.rotary_dim == 6


def test_yarn_keys_as_qwen2_5_writes_them():
    """Qwen2.5's long-context recipe: "type": "yarn" with the original length inside; a missing
    factor is the stretch from the original length to max_position_embeddings."""
    config = ModelConfig.from_hf_config({**BASE, "architectures": ["Qwen2ForCausalLM"], "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}})
    assert config.rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                                   "original_max_position_embeddings": 1024}
    stretched = ModelConfig.from_hf_config({**BASE, "original_max_position_embeddings": 512,
                                            "rope_scaling": {"rope_type": "yarn"}})
    assert stretched.rope_scaling["factor"] == 4096 / 512


def test_bidirectional_attention_refused():
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        ModelConfig.from_hf_config({**BASE, "architectures": ["Gemma3ForCausalLM"],
                                    "use_bidirectional_attention": True})


def gemma_gguf_metadata(arch: str, layers: int) -> dict:
    return {
        "general.architecture": arch, f"{arch}.block_count": layers,
        f"{arch}.context_length": 8192, f"{arch}.embedding_length": 2304,
        f"{arch}.feed_forward_length": 9216, f"{arch}.attention.head_count": 8,
        f"{arch}.attention.head_count_kv": 4, f"{arch}.attention.key_length": 256,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, "tokenizer.ggml.tokens": ["a"] * 10,
    }


def test_gemma_gguf_metadata_takes_llama_cpp_defaults():
    gemma2 = ModelConfig.from_gguf_metadata(gemma_gguf_metadata("gemma2", 4), set())
    assert gemma2.architecture == "Gemma2ForCausalLM" and gemma2.hidden_act == "gelu_pytorch_tanh"
    assert (gemma2.sliding_window, gemma2.sliding_layers) == (4096, (0, 2))
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)
    assert gemma2.query_pre_attn_scalar == 256  # head_dim, as for every size but 27B
    gemma2_27b = ModelConfig.from_gguf_metadata(gemma_gguf_metadata("gemma2", 46), set())
    assert gemma2_27b.query_pre_attn_scalar == 2304 // 8
    gemma3 = ModelConfig.from_gguf_metadata(
        {**gemma_gguf_metadata("gemma3", 7), "gemma3.attention.sliding_window": 512,
         "gemma3.rope.freq_base": 1e6}, set())
    assert gemma3.sliding_layers == (0, 1, 2, 3, 4, 6) and gemma3.local_rope_theta == 1e4
    assert gemma3.attn_logit_softcapping is None and gemma3.final_logit_softcapping is None


def test_every_supported_rope_type_is_implemented():
    from pagedllm.model.config import SUPPORTED_ROPE_TYPES
    from pagedllm.model.rope import ROPE_TYPES

    assert set(ROPE_TYPES) == set(SUPPORTED_ROPE_TYPES)


def test_gpt_oss_released_config():
    """gpt-oss-20b's config.json keys (rope_scaling and rope_theta apart, as released): its windows,
    YaRN without truncation, and how its experts route and gate."""
    config = ModelConfig.from_hf_config({
        **BASE, "architectures": ["GptOssForCausalLM"], "num_hidden_layers": 4, "head_dim": 64,
        "num_key_value_heads": 2, "attention_bias": True, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "num_local_experts": 32,
        "num_experts_per_tok": 4, "swiglu_limit": 7.0, "rope_theta": 150000,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "rope_type": "yarn",
                         "original_max_position_embeddings": 4096, "truncate": False},
        "quantization_config": {"quant_method": "mxfp4"}})
    assert config.arch.attention_sinks and (config.attention_bias, config.output_bias) == (True, True)
    assert (config.sliding_window, config.sliding_layers, config.kv_window) == (128, (0, 2), None)
    assert config.rope_theta == 150000 and config.rope_scaling["truncate"] is False
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (32, 4, 128)
    assert (config.topk_method, config.router_bias, config.mlp_bias) == ("topk_softmax", True, True)
    assert (config.swiglu_limit, config.swiglu_alpha) == (7.0, 1.702)
