"""Tiny random Llama-family checkpoints made at test time with transformers, in several shapes,
plus a tiny byte-level tokenizer and a GGUF writer that lays tensors out as llama.cpp does."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from pagedllm.text.tokenizer import _bytes_to_unicode

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
    # YaRN over an original context of 2048: the ramp between kept and interpolated frequencies
    # covers dimensions 2 to 6 of 8, and cos/sin are scaled by 0.1 ln 4 + 1.
    "qwen2_yarn_rope": ("Qwen2Config", dict(max_position_embeddings=8192, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048})),
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
    # Mixtures of experts: top-2 of 4 experts, so a batch leaves some experts without tokens.
    # Qwen3-MoE: layer 1 of 3 dense (mlp_only_layers), scores not renormalized.
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        num_hidden_layers=3, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=False)),
    # Qwen2-MoE: q/k/v bias, a gated shared expert beside the routed ones, layer 1 of 3 dense
    # (mlp_only_layers), scores not renormalized.
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, mlp_only_layers=[1], norm_topk_prob=False)),
    # Latent attention: q through its own low-rank projection (V3) or not (V2); DeepSeek's experts
    # (a dense first layer, shared experts, grouped routing).
    "deepseek_v2_mla": ("DeepseekV2Config", dict(
        num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, moe_intermediate_size=32,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5)),
    "deepseek_v3_mla": ("DeepseekV3Config", dict(
        num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, moe_intermediate_size=32,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)),
    # Hybrid (Qwen3.5): Gated DeltaNet layers (two value heads per key head) around two gated
    # attention layers with partial rotary; the A_log and dt_bias of the defaults.
    "qwen3_5_hybrid": ("Qwen3_5TextConfig", dict(
        num_hidden_layers=4, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])),
    # Hybrid (Granite 4): Mamba2 layers (8 heads in 2 groups) around two attention layers with
    # rotary, routed experts beside the shared MLP, and every one of Granite's scalings.
    "granite4_hybrid": ("GraniteMoeHybridConfig", dict(
        num_hidden_layers=4, intermediate_size=32, shared_intermediate_size=48, num_local_experts=4,
        num_experts_per_tok=2, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_head=16,
        mamba_d_conv=4, mamba_expand=2, layer_types=["mamba", "attention", "mamba", "attention"],
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0,
        position_embedding_type="rope")),
    "mixtral_moe": ("MixtralConfig", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=None)),
    # gpt-oss: attention sinks (randomized large, _randomized), windowed layers 0 and 2 around a
    # full one, biases on q/k/v/o, the router and every expert; a SwiGLU limit low enough that the
    # clamps bite; YaRN without truncation over an original context of 16, so its ramp moves.
    "gpt_oss": ("GptOssConfig", dict(
        num_hidden_layers=3, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=32, sliding_window=5, swiglu_limit=1.5, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 16, "rope_theta": 1e4})),
}


def make_hf_model(shape: str, seed: int = 0, **overrides):
    """A random transformers model with weights large enough that mistakes show in the logits
    (the default init is so small that almost any bug stays under a 1e-4 tolerance).
    overrides: config arguments that replace the shape's."""
    import transformers

    class_name, args = SHAPES[shape]
    config = getattr(transformers, class_name)(**{**_COMMON, **args, **overrides})
    torch.manual_seed(seed)
    return _randomized(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32))


def make_hf_classifier(shape: str, num_labels: int, seed: int = 0, **overrides):
    """The shape's *ForSequenceClassification (its decoder and a score head of num_labels), with
    make_hf_model's large random weights; pad id 0, a byte no test text holds (transformers pools
    at the last token that is not padding)."""
    import transformers

    class_name, args = SHAPES[shape]
    config = getattr(transformers, class_name)(**{**_COMMON, **args, "num_labels": num_labels,
                                                  "pad_token_id": 0, **overrides})
    torch.manual_seed(seed)
    classifier = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    return _randomized(classifier)


def _randomized(model):
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("self_attn.sinks"):  # gpt-oss: as large as the scores, so they show
                param.copy_(1.5 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router bias: a buffer
                buffer.copy_(0.5 * torch.randn_like(buffer))
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


# transformers model_type -> the GGUF architecture llama.cpp's converter writes it as.
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
              "gemma3_text": "gemma3", "phi3": "phi3", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe",
              "mixtral": "llama",  # llama.cpp writes Mixtral as a Llama with experts
              "gpt_oss": "gpt-oss",
              "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2",
              "qwen3_5_text": "qwen35", "granitemoehybrid": "granitehybrid"}
# Config arguments a model needs to be what llama.cpp's GGUF of it runs (its converter writes no
# key for them, or llama.cpp's loader fixes them): the model to compare a GGUF against.
GGUF_OVERRIDES: dict[str, dict] = {
    "qwen3_moe": {"mlp_only_layers": [], "norm_topk_prob": True},  # every layer sparse, renormalized
    "qwen2_moe": {"mlp_only_layers": []},  # every layer sparse, top-k never renormalized
    "gpt_oss": {"swiglu_limit": 7.0},  # no key holds the SwiGLU's clamp: llama.cpp runs 7.0
}
# Families whose GGUF files we refuse (their recurrent layers' tensors are not mapped): written
# under the names gguf's map gives, the tensors it has no name for left out, no converter
# transforms; only good for seeing the refusal.
REFUSED_GGUF_ARCHS = ("qwen35",)


def write_gguf(hf_model, path: Path, raw_types: dict | None = None,
               quantize: dict | None = None, split_kv_b: bool = True, extra: dict | None = None) -> Path:
    """The model as llama.cpp's converter would write it (F32): its metadata keys, tensor names
    from gguf's own name map, q/k rows permuted for Llama, Gemma's norms stored as 1 + weight,
    Phi-3's LongRoPE factors as tensors.

    raw_types maps a GGUF tensor name to a quantization type whose bytes are written as zeros,
    to test how unsupported types are refused; quantize, to a quantization type it is stored in
    (quant_blocks.quantized_blocks: quantized by gguf where it can, else random blocks). split_kv_b:
    DeepSeek's kv_b_proj as attn_k_b and attn_v_b, as llama.cpp's converter writes it now (False:
    attn_kv_b, as older files hold it). extra: more tensors by GGUF name, written as they are."""
    import gguf

    from tests.model.quant_blocks import quantized_blocks

    config = hf_model.config
    arch = GGUF_ARCHS[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    _add_hparams(writer, config, arch)
    _add_tokenizer(writer)
    tensors = _gguf_tensors(hf_model, arch)
    if split_kv_b:
        tensors = _split_kv_b(tensors, config)
    for name, tensor in {**tensors, **(extra or {})}.items():
        array = tensor.detach().numpy().astype(np.float32)
        qtype = (raw_types or {}).get(name)
        if name in (quantize or {}):
            writer.add_tensor(name, quantized_blocks(array, quantize[name]), raw_dtype=quantize[name])
        elif qtype is None:
            writer.add_tensor(name, array)
        else:
            *rows, cols = array.shape
            block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((*rows, cols // block_elems * block_bytes), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_hparams(writer, config, arch: str) -> None:
    import gguf

    rope = config.rope_parameters
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers'
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "deepseek2":
        _add_deepseek2_hparams(writer, config)
        return
    if arch == "granitehybrid":
        _add_granite_hybrid_hparams(writer, config)
        return
    writer.add_head_count_kv(config.num_key_value_heads)
    if getattr(config, "head_dim", None):
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if arch in ("qwen3moe", "qwen2moe"):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
        if arch == "gpt-oss":
            writer.add_expert_feed_forward_length(config.intermediate_size)
            writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(config.sliding_window)
    if arch == "phi3":
        head_dim = config.hidden_size // config.num_attention_heads
        writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * head_dim))
        writer.add_sliding_window(config.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            original = rope["original_max_position_embeddings"]
            writer.add_rope_scaling_orig_ctx_len(original)
            scale = config.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(original)))


def _add_deepseek2_hparams(writer, config) -> None:
    """As llama.cpp's converter writes DeepSeek-V2/V3: the latent cache as one KV head of
    kv_lora_rank + rope dims, the uncompressed heads' sizes under the _mla keys, the router's
    gating function and groups, the scale and renormalization of the routed weights."""
    import gguf

    kv_lora, rope, nope = config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim
    writer.add_head_count_kv(1)
    writer.add_key_length(kv_lora + rope)
    writer.add_value_length(kv_lora)
    writer.add_key_length_mla(nope + rope)
    writer.add_value_length_mla(config.v_head_dim)
    writer.add_kv_lora_rank(kv_lora)
    if config.q_lora_rank:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_rope_dimension_count(rope)
    writer.add_vocab_size(config.vocab_size)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    if getattr(config, "norm_topk_prob", False):
        writer.add_expert_weights_norm(True)
    sigmoid = config.model_type == "deepseek_v3"
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid
                                  else gguf.ExpertGatingFuncType.SOFTMAX)
    writer.add_expert_group_count(config.n_group)
    writer.add_expert_group_used_count(config.topk_group)


def _add_granite_hybrid_hparams(writer, config) -> None:
    """As llama.cpp's converter writes Granite 4's hybrids: KV heads per layer (0 on Mamba2 ones),
    the ssm sizes, Granite's multipliers as scales, rotary only where rope.scaling.finetuned says
    (never, for these: give the model position_embedding_type="nope")."""
    kinds = config.layer_types
    writer.add_head_count_kv([config.num_key_value_heads if k in ("attention", "full_attention") else 0
                              for k in kinds])
    writer.add_ssm_conv_kernel(config.mamba_d_conv)
    writer.add_ssm_state_size(config.mamba_d_state)
    writer.add_ssm_group_count(config.mamba_n_groups)
    writer.add_ssm_inner_size(config.mamba_expand * config.hidden_size)
    writer.add_ssm_time_step_rank(config.mamba_n_heads)
    writer.add_rope_scaling_finetuned(False)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)
    writer.add_attention_scale(config.attention_multiplier)
    writer.add_embedding_scale(config.embedding_multiplier)
    writer.add_residual_scale(config.residual_multiplier)
    writer.add_logit_scale(config.logits_scaling)


# transformers' Granite hybrid names (after the layer's prefix) -> llama.cpp's (after blk.N.).
_GRANITE_HYBRID_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mamba.in_proj.weight": "ssm_in.weight", "mamba.out_proj.weight": "ssm_out.weight",
    "mamba.conv1d.weight": "ssm_conv1d.weight", "mamba.conv1d.bias": "ssm_conv1d.bias",
    "mamba.dt_bias": "ssm_dt.bias", "mamba.A_log": "ssm_a", "mamba.D": "ssm_d",
    "mamba.norm.weight": "ssm_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "block_sparse_moe.router.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.experts.down_proj": "ffn_down_exps.weight",
    "shared_mlp.output_linear.weight": "ffn_down_shexp.weight",
}


def _granite_hybrid_tensor(name: str, tensor: torch.Tensor, config) -> dict[str, torch.Tensor]:
    """One layer tensor as llama.cpp's converter writes it: gate and up halves apart, q/k rows
    permuted as Llama's, A as -exp(A_log), A and D as [heads, 1], the conv weight squeezed, the
    gated norm's weight per group."""
    layer, ours = name.split(".", 3)[2], name.split(".", 3)[3]
    blk = f"blk.{layer}."
    if ours == "block_sparse_moe.experts.gate_up_proj":  # [E, 2I, H]
        gate, up = tensor.chunk(2, dim=1)
        return {blk + "ffn_gate_exps.weight": gate, blk + "ffn_up_exps.weight": up}
    if ours == "shared_mlp.input_linear.weight":
        gate, up = tensor.chunk(2, dim=0)
        return {blk + "ffn_gate_shexp.weight": gate, blk + "ffn_up_shexp.weight": up}
    theirs = _GRANITE_HYBRID_TENSORS[ours]
    if theirs == "attn_q.weight":
        tensor = _llama_cpp_permute(tensor, config.num_attention_heads)
    elif theirs == "attn_k.weight":
        tensor = _llama_cpp_permute(tensor, config.num_key_value_heads)
    elif theirs == "ssm_a":
        tensor = -torch.exp(tensor).reshape(-1, 1)
    elif theirs == "ssm_d":
        tensor = tensor.reshape(-1, 1)
    elif theirs == "ssm_conv1d.weight":
        tensor = tensor.squeeze(1)
    elif theirs == "ssm_norm.weight":
        tensor = tensor.reshape(config.mamba_n_groups, -1)
    return {blk + theirs: tensor}


def _split_kv_b(tensors: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """llama.cpp's converter splits each kv_b_proj (attn_kv_b) per head into k_b (transposed:
    [heads, kv_lora_rank, nope], for absorbing it into the query) and v_b [heads, v, kv_lora_rank]."""
    out = {}
    for name, tensor in tensors.items():
        if not name.endswith(".attn_kv_b.weight"):
            out[name] = tensor
            continue
        nope, v = config.qk_nope_head_dim, config.v_head_dim
        per_head = tensor.reshape(config.num_attention_heads, nope + v, tensor.shape[-1])
        k_b, v_b = per_head.split([nope, v], dim=1)
        out[name.replace("attn_kv_b", "attn_k_b")] = k_b.transpose(1, 2).contiguous()
        out[name.replace("attn_kv_b", "attn_v_b")] = v_b.contiguous()
    return out


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


def _stacked_experts(hf_name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers holds a layer's experts as gate_up [E, 2I, H] and down [E, H, I]; llama.cpp's
    files as ffn_gate_exps and ffn_up_exps [E, I, H] and ffn_down_exps [E, H, I]."""
    layer = hf_name.split(".")[2]
    if hf_name.endswith("gate_up_proj"):
        gate, up = tensor.chunk(2, dim=1)
        return {f"blk.{layer}.ffn_gate_exps.weight": gate, f"blk.{layer}.ffn_up_exps.weight": up}
    return {f"blk.{layer}.ffn_down_exps.weight": tensor}


def _gpt_oss_experts(hf_name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """gpt-oss's stacked experts as llama.cpp's converter writes them: gate_up_proj [E, H, 2I]
    (inputs first, gate and up columns interleaved) split into ffn_gate_exps and ffn_up_exps
    [E, I, H], down_proj [E, I, H] as ffn_down_exps [E, H, I]; the biases alike."""
    layer = hf_name.split(".")[2]
    kind = "bias" if hf_name.endswith("_bias") else "weight"
    if kind == "weight":
        tensor = tensor.transpose(1, 2)
    if "gate_up_proj" in hf_name:
        return {f"blk.{layer}.ffn_gate_exps.{kind}": tensor[:, 0::2],
                f"blk.{layer}.ffn_up_exps.{kind}": tensor[:, 1::2]}
    return {f"blk.{layer}.ffn_down_exps.{kind}": tensor}


def _gguf_tensors(hf_model, arch: str) -> dict[str, torch.Tensor]:
    import gguf

    config = hf_model.config
    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    out = {}
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if arch == "granitehybrid" and hf_name.startswith("model.layers."):
            out.update(_granite_hybrid_tensor(hf_name, tensor, config))
            continue
        if ".mlp.experts." in hf_name:  # transformers' fused experts: llama.cpp's stacked ones
            out.update(_gpt_oss_experts(hf_name, tensor) if arch == "gpt-oss"
                       else _stacked_experts(hf_name, tensor))
            continue
        if hf_name.endswith("e_score_correction_bias"):  # llama.cpp's converter renames it first
            hf_name = hf_name.replace("_bias", ".bias")
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None and arch in REFUSED_GGUF_ARCHS:
            continue
        if hf_name.endswith("self_attn.sinks"):  # llama.cpp's converter gives them a suffix
            name += ".weight"
        if arch == "llama" and ".attn_q." in name:
            tensor = _llama_cpp_permute(tensor, config.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            tensor = _llama_cpp_permute(tensor, config.num_key_value_heads)
        elif arch.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1
        out[name] = tensor
    rope = config.rope_parameters
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        out["rope_factors_long.weight"] = torch.tensor(rope["long_factor"])
        out["rope_factors_short.weight"] = torch.tensor(rope["short_factor"])
    return out
