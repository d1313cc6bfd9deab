"""The config fields of the families that go beyond a Llama's shape, read from config.json and GGUF
metadata: mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek) and multi-head latent attention
(DeepSeek-V2/V3). model/config.py's ModelConfig declares the fields; this says where they come from.
"""

from __future__ import annotations

from typing import Any

from pagedllm.model.errors import ModelLoadError, UnsupportedModelError

_DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


def hf_sparse_and_latent_fields(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    if architecture == "Qwen2MoeForCausalLM":
        config = {**_QWEN2_MOE_DEFAULTS, **config}
    fields = _hf_moe(config, architecture)
    if architecture == "Qwen2MoeForCausalLM":
        fields.update(_hf_qwen2_moe(config, bool(fields)))
    if architecture in _DEEPSEEK:
        fields.update(_hf_mla(config, architecture))
    if architecture == "Qwen3_5ForCausalLM":
        fields.update(_hf_qwen3_5(config, architecture))
    if architecture == "GraniteMoeHybridForCausalLM":
        fields.update(_hf_granite_hybrid(config, architecture))
    return fields


# transformers' older names for layer kinds, which checkpoints still carry.
_LEGACY_LAYER_KINDS = {"mamba": "linear_attention", "attention": "full_attention"}
_LINEAR_SIZES = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim")


def _check_hybrid(kinds: list[str], architecture: str) -> tuple[str, ...]:
    kinds = tuple(_LEGACY_LAYER_KINDS.get(k, k) for k in kinds)
    if "linear_attention" not in kinds:
        raise UnsupportedModelError(f"{architecture} without any recurrent (linear_attention) layer "
                                    "is not supported")
    return kinds


def _hf_qwen3_5(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """Qwen3.5's layer kinds (layer_types, or every full_attention_interval-th layer attending, as
    transformers fills them in) and its Gated DeltaNet sizes."""
    layers = config["num_hidden_layers"]
    kinds = config.get("layer_types") or [
        "full_attention" if (i + 1) % config.get("full_attention_interval", 4) == 0
        else "linear_attention" for i in range(layers)]
    missing = [name for name in _LINEAR_SIZES if not config.get(name)]
    if missing:
        raise UnsupportedModelError(f"{architecture} config lacks {', '.join(missing)}")
    sizes = {name: config[name] for name in _LINEAR_SIZES}
    if sizes["linear_num_value_heads"] % sizes["linear_num_key_heads"]:
        raise UnsupportedModelError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    return dict(layer_types=_check_hybrid(kinds, architecture), **sizes)


def _hf_granite_hybrid(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """Granite 4's Mamba2 sizes, layer kinds (layer_types or layers_block_type, all Mamba2 where
    neither is given), scalings, and its routed experts beside a shared MLP (none: dense)."""
    layers = config["num_hidden_layers"]
    kinds = config.get("layer_types") or config.get("layers_block_type") or ["linear_attention"] * layers
    hidden, heads = config["hidden_size"], config.get("mamba_n_heads", 128)
    intermediate = config.get("mamba_expand", 2) * hidden
    head_dim = config.get("mamba_d_head", "auto")
    if head_dim == "auto":
        head_dim = intermediate // heads
    groups = config.get("mamba_n_groups", 1)
    if head_dim * heads != intermediate or heads % groups:
        raise UnsupportedModelError(f"{architecture}: mamba_n_heads x mamba_d_head must be "
                                    "mamba_expand x hidden_size, in whole groups")
    position = config.get("position_embedding_type")
    if position not in (None, "nope", "rope"):
        raise UnsupportedModelError(f"{architecture}: position_embedding_type {position!r} is not "
                                    "supported (rope, nope)")
    # transformers writes an infinite limit as {"__float__": "Infinity"}
    limit = [float(v["__float__"]) if isinstance(v, dict) else float(v)
             for v in config.get("time_step_limit") or (0.0, float("inf"))]
    experts = config.get("num_local_experts") or 0
    shared = config.get("shared_intermediate_size") or 0
    moe = dict(num_experts=experts, num_experts_per_tok=config.get("num_experts_per_tok") or 0,
               moe_intermediate_size=config["intermediate_size"], norm_topk_prob=True,
               shared_expert_intermediate_size=shared) if experts else dict(intermediate_size=shared)
    return dict(
        layer_types=_check_hybrid(kinds, architecture), mamba_n_heads=heads,
        mamba_d_head=head_dim, mamba_n_groups=groups, mamba_d_state=config.get("mamba_d_state", 256),
        mamba_d_conv=config.get("mamba_d_conv", 4), mamba_conv_bias=bool(config.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(config.get("mamba_proj_bias", False)),
        mamba_time_step_limit=(limit[0], limit[1]),
        embedding_multiplier=float(config.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(config.get("residual_multiplier", 1.0)),
        attention_multiplier=float(config.get("attention_multiplier", 1.0)),
        logits_scaling=float(config.get("logits_scaling", 1.0)), use_rope=position == "rope", **moe)


# What transformers' Qwen2MoeConfig takes for the keys a config.json leaves out.
_QWEN2_MOE_DEFAULTS = dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                           shared_expert_intermediate_size=5632, norm_topk_prob=False,
                           decoder_sparse_step=1, qkv_bias=True, sliding_window=4096, max_window_layers=28)


def _hf_qwen2_moe(config: dict[str, Any], sparse: bool) -> dict[str, Any]:
    """Qwen2-MoE: q/k/v bias as qkv_bias says (none on o_proj); on its sparse layers one shared
    expert of shared_expert_intermediate_size (0: none; transformers' MLP of width 0 adds zeros)
    whose output a sigmoid gate scales (architectures.py); and, where config.json lists no
    layer_types, its own sliding layers: every other one (0, 2, ...) below max_window_layers."""
    fields: dict[str, Any] = dict(attention_bias=bool(config["qkv_bias"]), output_bias=False)
    if sparse:
        fields["shared_expert_intermediate_size"] = config["shared_expert_intermediate_size"] or 0
    if config.get("use_sliding_window") and config["sliding_window"] and not config.get("layer_types"):
        below = min(config["max_window_layers"], config["num_hidden_layers"])
        fields.update(sliding_window=config["sliding_window"], sliding_layers=tuple(range(0, below, 2)))
    return fields


# gpt-oss's experts, on every layer, intermediate_size wide: the router's logits carry a bias, the
# top k of them are softmaxed among themselves, and every expert projection has a bias.
_GPT_OSS_MOE = dict(topk_method="topk_softmax", router_bias=True, mlp_bias=True)


def _hf_moe(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """Mixtral's and gpt-oss's experts are intermediate_size wide, on every layer, their top-k
    scores always renormalized (gpt-oss: softmaxed among themselves); Qwen2-MoE's and Qwen3-MoE's
    are moe_intermediate_size wide, on every decoder_sparse_step-th layer (counting from 1) not in
    mlp_only_layers; DeepSeek's on every layer from first_k_dense_replace on, beside shared
    experts."""
    experts = next((config[k] for k in ("num_local_experts", "num_experts", "n_routed_experts")
                    if config.get(k)), 0)
    if not experts:
        return {}
    top_k = config.get("num_experts_per_tok")
    if architecture == "GptOssForCausalLM":
        return dict(num_experts=experts, num_experts_per_tok=top_k,
                    moe_intermediate_size=config["intermediate_size"],
                    swiglu_limit=float(config.get("swiglu_limit", 7.0)),
                    swiglu_alpha=float(config.get("swiglu_alpha", 1.702)), **_GPT_OSS_MOE)
    if architecture == "MixtralForCausalLM":
        return dict(num_experts=experts, num_experts_per_tok=top_k,
                    moe_intermediate_size=config["intermediate_size"], norm_topk_prob=True)
    layers = range(config["num_hidden_layers"])
    fields = dict(num_experts=experts, num_experts_per_tok=top_k,
                  moe_intermediate_size=config.get("moe_intermediate_size") or config["intermediate_size"],
                  norm_topk_prob=bool(config.get("norm_topk_prob", False)))
    if architecture in _DEEPSEEK:
        first, freq = config.get("first_k_dense_replace", 0), config.get("moe_layer_freq", 1)
        v3 = architecture == "DeepseekV3ForCausalLM"
        return {**fields, "moe_layers": tuple(i for i in layers if i >= first and i % freq == 0),
                "shared_expert_intermediate_size":
                    fields["moe_intermediate_size"] * (config.get("n_shared_experts") or 0),
                "routed_scaling_factor": float(config.get("routed_scaling_factor", 1.0)),
                "topk_method": "noaux_tc" if v3 else config.get("topk_method", "greedy"),
                "scoring_func": "sigmoid" if v3 else "softmax",
                "n_group": config.get("n_group") or 1, "topk_group": config.get("topk_group") or 1}
    step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or ())
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ModelLoadError(f"config.json: decoder_sparse_step must be a positive integer; got {step!r}")
    return {**fields, "moe_layers": tuple(i for i in layers if i not in dense and (i + 1) % step == 0)}


def _hf_mla(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The latent attention's sizes; the cache's geometry (one head of the latent and the rotary
    key) in num_key_value_heads and head_dim, and rotary over the rotary key's dimensions only."""
    kv_lora, rope = config.get("kv_lora_rank"), config.get("qk_rope_head_dim")
    if not kv_lora or not rope:
        raise UnsupportedModelError(f"{architecture} without kv_lora_rank and qk_rope_head_dim "
                                    "(latent attention) is not supported")
    if config.get("attention_bias"):
        raise UnsupportedModelError(f"{architecture} with attention_bias is not supported")
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if scaling.get("mscale_all_dim"):
        raise UnsupportedModelError(f"{architecture}: YaRN rope scaling with mscale_all_dim is not "
                                    "supported yet")
    interleave = architecture == "DeepseekV2ForCausalLM" or config.get("rope_interleave", True)
    return dict(kv_lora_rank=kv_lora, q_lora_rank=config.get("q_lora_rank"),
                qk_nope_head_dim=config["qk_nope_head_dim"], qk_rope_head_dim=rope,
                v_head_dim=config["v_head_dim"], rope_interleave=bool(interleave),
                num_key_value_heads=1, head_dim=kv_lora + rope,
                partial_rotary_factor=rope / (kv_lora + rope))


# llama.cpp's expert_gating_func values (gguf.ExpertGatingFuncType): DeepSeek-V3's router is sigmoid.
SOFTMAX_GATING, SIGMOID_GATING = 1, 2


def gguf_latent_fields(key) -> dict[str, Any]:
    """DeepSeek's latent attention from llama.cpp's keys. Its files already give the cache's
    geometry as ours (head_count_kv 1, key_length kv_lora_rank + rope dims); the uncompressed
    heads' sizes are the _mla keys. llama.cpp rotates DeepSeek's rope dims as interleaved pairs."""
    kv_lora, rope = key("attention.kv_lora_rank"), key("rope.dimension_count")
    key_mla, value_mla = key("attention.key_length_mla"), key("attention.value_length_mla")
    missing = [name for name, value in (("attention.kv_lora_rank", kv_lora), ("rope.dimension_count", rope),
               ("attention.key_length_mla", key_mla), ("attention.value_length_mla", value_mla)) if not value]
    if missing:
        raise UnsupportedModelError(f"deepseek2 GGUF without {', '.join(missing)} (latent attention) "
                                    "is not supported")
    if key("rope.scaling.yarn_log_multiplier"):
        raise UnsupportedModelError("deepseek2: YaRN rope scaling with mscale_all_dim is not supported yet")
    return dict(kv_lora_rank=kv_lora, q_lora_rank=key("attention.q_lora_rank") or None,
                qk_nope_head_dim=key_mla - rope, qk_rope_head_dim=rope, v_head_dim=value_mla,
                rope_interleave=True)


def gguf_granite_hybrid_fields(key, tensor_names: set[str], kv_per_layer: list[int] | None) -> dict[str, Any]:
    """Granite 4's hybrids from llama.cpp's keys: the layer kinds from the per-layer KV head counts
    (0 on a Mamba2 layer), the ssm.* sizes, Granite's scales, the shared MLP's width (beside the
    experts, or as the dense MLP). llama.cpp turns rotary on only where rope.scaling.finetuned
    says so (Granite 4's hybrids have none)."""
    if not isinstance(kv_per_layer, list):
        raise UnsupportedModelError("granitehybrid GGUF without a per-layer attention.head_count_kv")
    kinds = ["full_attention" if heads else "linear_attention" for heads in kv_per_layer]
    heads, inner = key("ssm.time_step_rank"), key("ssm.inner_size")
    missing = [name for name in ("ssm.time_step_rank", "ssm.inner_size", "ssm.state_size", "ssm.conv_kernel")
               if not key(name)]
    if missing or inner % heads:
        raise UnsupportedModelError(f"granitehybrid GGUF: {', '.join(missing) or 'ssm.inner_size'} "
                                    "missing or not whole heads")
    first_ssm = kinds.index("linear_attention") if "linear_attention" in kinds else 0
    shared = key("expert_shared_feed_forward_length")
    width = dict(shared_expert_intermediate_size=shared) if key("expert_count") else \
        dict(intermediate_size=shared or key("feed_forward_length"))
    return dict(
        layer_types=_check_hybrid(kinds, "GraniteMoeHybridForCausalLM"), mamba_n_heads=heads,
        mamba_d_head=inner // heads, mamba_n_groups=key("ssm.group_count", 1),
        mamba_d_state=key("ssm.state_size"), mamba_d_conv=key("ssm.conv_kernel"),
        mamba_conv_bias=f"blk.{first_ssm}.ssm_conv1d.bias" in tensor_names,
        mamba_proj_bias=f"blk.{first_ssm}.ssm_in.bias" in tensor_names,
        embedding_multiplier=float(key("embedding_scale", 1.0)),
        residual_multiplier=float(key("residual_scale", 1.0)),
        attention_multiplier=key("attention.scale"), logits_scaling=float(key("logit_scale", 1.0)),
        use_rope=bool(key("rope.scaling.finetuned", False)), **width)
def gguf_moe_fields(key, tensor_names: set[str], layers: int, architecture: str) -> dict[str, Any]:
    """From llama.cpp's keys; the sparse layers are those with a router tensor, and they have a
    shared expert where their ffn_*_shexp tensors are there (Qwen2-MoE: as wide as
    expert_shared_feed_forward_length says, else feed_forward_length, as llama.cpp reads it).
    llama.cpp renormalizes the top-k scores unless the file says otherwise (or, for qwen2moe,
    config.py's _LLAMA_CPP_DEFAULTS). gpt-oss's files hold no key for its SwiGLU's clamp: llama.cpp
    runs it with transformers' defaults, 7.0 and 1.702. DeepSeek's: expert_shared_count shared
    experts of the routed ones' width, the routed weights' scale, and the routing its gating
    function and expert groups say (as _hf_moe reads it from config.json)."""
    experts = key("expert_count", 0)
    if not experts:
        return {}
    moe_layers = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names)
    shared = any(f"blk.{i}.ffn_down_shexp.weight" in tensor_names for i in moe_layers)
    fields = dict(num_experts=experts, num_experts_per_tok=key("expert_used_count", 0),
                  moe_intermediate_size=key("expert_feed_forward_length") or key("feed_forward_length"),
                  norm_topk_prob=bool(key("expert_weights_norm", True)), moe_layers=moe_layers,
                  shared_expert_intermediate_size=(key("expert_shared_feed_forward_length")
                                                   or key("feed_forward_length")) if shared else 0)
    if architecture == "GptOssForCausalLM":
        fields.update(swiglu_limit=7.0, swiglu_alpha=1.702, **_GPT_OSS_MOE)
    shared_count = key("expert_shared_count", 0)
    if shared_count:  # DeepSeek: shared experts as wide as the routed ones, routed by its rules
        sigmoid = key("expert_gating_func", SOFTMAX_GATING) == SIGMOID_GATING
        groups = key("expert_group_count", 1)
        method = "noaux_tc" if sigmoid else "group_limited_greedy" if groups > 1 else "greedy"
        fields.update(shared_expert_intermediate_size=fields["moe_intermediate_size"] * shared_count,
                      routed_scaling_factor=float(key("expert_weights_scale", 1.0)), topk_method=method,
                      scoring_func="sigmoid" if sigmoid else "softmax", n_group=groups,
                      topk_group=key("expert_group_used_count", 1))
    return fields
