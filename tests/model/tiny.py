"""Tiny random Llama-family checkpoints made at test time with transformers, in several shapes,
plus a tiny byte-level tokenizer and a GGUF writer that lays tensors out as llama.cpp does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from pagedllm.tokenizer import _bytes_to_unicode

VOCAB_SIZE = 300  # 256 byte tokens, 2 special tokens, and spare rows the tokenizer never emits
BOS, EOS = "<|bos|>", "<|eos|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")

_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               rms_norm_eps=1e-5, bos_token_id=256, eos_token_id=257)

# name -> (transformers config class name, its arguments)
SHAPES: dict[str, tuple[str, dict]] = {
    "llama_gqa_untied": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama_mha_tied_bias": ("LlamaConfig", dict(
        num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
        head_dim=24)),
    "qwen2_qkv_bias": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "llama3_rope": ("LlamaConfig", dict(rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    "mistral_linear_rope_window": ("MistralConfig", dict(
        sliding_window=6, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama_dynamic_rope": ("LlamaConfig", dict(
        max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    # head_dim apart from hidden_size / heads, as in the real Qwen3 models.
    "qwen3_qk_norm": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    # Windowed and global layers alternating; both soft-caps small enough to bend the values.
    "gemma2_softcap_window": ("Gemma2Config", dict(
        head_dim=16, num_hidden_layers=3, query_pre_attn_scalar=24, sliding_window=5,
        attn_logit_softcapping=5.0, final_logit_softcapping=10.0, pad_token_id=0)),
    # Layer 5 of 7 global (the default pattern of 6), with its scaled rope; the others windowed,
    # with their own rope base.
    "gemma3_local_rope": ("Gemma3TextConfig", dict(
        head_dim=16, num_hidden_layers=7, query_pre_attn_scalar=24, sliding_window=5,
        pad_token_id=0, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    # The test sequences run past original_max_position_embeddings: long factors from there on.
    "phi3_longrope_window": ("Phi3Config", dict(
        sliding_window=10, original_max_position_embeddings=16, pad_token_id=0,
        rope_scaling={"type": "longrope", "short_factor": [1 + 0.1 * i for i in range(8)],
                      "long_factor": [2 + 0.3 * i for i in range(8)]})),
    # Phi-4-mini's shape: rotary over part of each head, tied embeddings.
    "phi4_partial_rotary": ("Phi3Config", dict(
        partial_rotary_factor=0.5, tie_word_embeddings=True, pad_token_id=0)),
}


def make_hf_model(shape: str, seed: int = 0):
    """A random transformers model with weights large enough that mistakes show in the logits
    (the default init is so small that almost any bug stays under a 1e-4 tolerance)."""
    import transformers

    class_name, args = SHAPES[shape]
    config = getattr(transformers, class_name)(**{**_COMMON, **args})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    return model.eval()


def save_checkpoint(hf_model, folder: Path, **save_kwargs) -> Path:
    hf_model.save_pretrained(folder, **save_kwargs)
    write_tokenizer(folder)
    return folder


def tokenizer_backend() -> Tokenizer:
    """Byte-level BPE with no merges: every byte its own token, ids 0..255."""
    spelling = _bytes_to_unicode()
    vocab = {spelling[b]: b for b in range(256)}
    backend = Tokenizer(models.BPE(vocab, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(BOS, special=True, normalized=False),
                                AddedToken(EOS, special=True, normalized=False)])
    return backend


def write_tokenizer(folder: Path, chat_template: str | None = CHAT_TEMPLATE) -> None:
    tokenizer_backend().save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": {"content": EOS, "special": True}}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def write_gguf(hf_model, path: Path, raw_types: dict | None = None) -> Path:
    """The model as llama.cpp's converter would write it (F32, q/k rows permuted).

    raw_types maps a GGUF tensor name to a quantization type whose bytes are written as zeros,
    to test how unsupported types are refused."""
    import gguf

    config = hf_model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    _add_tokenizer(writer)
    for name, tensor in _gguf_tensors(hf_model).items():
        array = tensor.detach().numpy().astype(np.float32)
        qtype = (raw_types or {}).get(name)
        if qtype is None:
            writer.add_tensor(name, array)
        else:
            rows, cols = array.shape
            block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((rows, cols // block_elems * block_bytes), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer) -> None:
    spelling = _bytes_to_unicode()
    tokens = [spelling[b] for b in range(256)] + [BOS, EOS]
    tokens += [f"<unused{i}>" for i in range(VOCAB_SIZE - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3, 3] + [5] * (VOCAB_SIZE - 258))
    writer.add_token_merges([])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)


def _llama_cpp_permute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to q/k rows: halves of each head become pairs."""
    rows = weights.shape[0]
    return (weights.reshape(heads, 2, rows // heads // 2, *weights.shape[1:])
            .transpose(1, 2).reshape(weights.shape))


def _gguf_tensors(hf_model) -> dict[str, torch.Tensor]:
    config = hf_model.config
    state = hf_model.state_dict()
    out = {"token_embd.weight": state["model.embed_tokens.weight"],
           "output_norm.weight": state["model.norm.weight"]}
    if not config.tie_word_embeddings:
        out["output.weight"] = state["lm_head.weight"]
    parts = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(config.num_hidden_layers):
        for ours, theirs in parts.items():
            tensor = state[f"model.layers.{i}.{theirs}.weight"]
            if ours == "attn_q":
                tensor = _llama_cpp_permute(tensor, config.num_attention_heads)
            elif ours == "attn_k":
                tensor = _llama_cpp_permute(tensor, config.num_key_value_heads)
            out[f"blk.{i}.{ours}.weight"] = tensor
    return out
