"""The shape of a Llama-family model, read from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.config import DTYPES, canonical_dtype
from pagedllm.model.architectures import (
    ACTIVATIONS,
    ARCHITECTURES,
    GGUF_ARCHITECTURES,
    Architecture,
)
from pagedllm.model.config_parts import (
    SIGMOID_GATING,
    gguf_granite_hybrid_fields,
    gguf_latent_fields,
    gguf_moe_fields,
    hf_sparse_and_latent_fields,
)
from pagedllm.model.errors import ModelLoadError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# The rope types model/rope.py's ROPE_TYPES implements.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

# GGUF general.file_type for unquantized files; quantized ones are dequantized to float32.
_GGUF_FILE_DTYPES = {0: torch.float32, 1: torch.float16, 32: torch.bfloat16}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain rotary embeddings; otherwise has "rope_type" in SUPPORTED_ROPE_TYPES.
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q, k and v projections
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    # The checkpoint's dtype when parsed; the dtype the weights are held in once loaded.
    dtype: torch.dtype = torch.float32
    output_bias: bool = False  # bias on o_proj (Llama's attention_bias sets both)
    mlp_bias: bool = False
    # Keys further back than this are not attended to, on the layers listed in sliding_layers
    # (every layer when None).
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None
    hidden_act: str = "silu"  # the MLP's gate activation, a key of ACTIVATIONS
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 where set, else head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # Soft-capping, x -> cap * tanh(x / cap), of the attention scores and of the final logits.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # The rope base of the sliding-window layers where it differs from rope_theta (Gemma 3);
    # rope_scaling does not apply to them.
    local_rope_theta: float | None = None
    # The share of each head's dimensions that rotary turns; the rest pass through unchanged.
    partial_rotary_factor: float = 1.0
    # Mixture of experts (model/moe.py): num_experts > 0 makes the MLP of the layers in moe_layers
    # (every layer when None) a router over that many experts of moe_intermediate_size, each
    # token taking num_experts_per_tok of them, their scores renormalized where norm_topk_prob.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] | None = None
    # DeepSeek's and Qwen2-MoE's shared experts (one MLP this wide, every token; Qwen2-MoE's scaled
    # by its gate, architectures.py), and DeepSeek's: the routed weights' factor, and how experts
    # are picked (model/moe.py's route says each way).
    shared_expert_intermediate_size: int = 0
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"  # greedy | group_limited_greedy | noaux_tc | topk_softmax
    scoring_func: str = "softmax"  # softmax | sigmoid
    n_group: int = 1
    topk_group: int = 1
    # gpt-oss's experts: a bias on the router's logits, and the clamped SwiGLU (the gate capped
    # above at swiglu_limit, up clamped to +-swiglu_limit, out = (up + 1) * gate * sigmoid(alpha *
    # gate)) instead of SiLU(gate) * up; None: the plain gated activation.
    router_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # Multi-head latent attention (DeepSeek-V2/V3, model/mla.py): a token's keys and values are one
    # latent of kv_lora_rank values and one rotary key of qk_rope_head_dim shared by every head, so
    # the cache holds one "KV head" of head_dim = kv_lora_rank + qk_rope_head_dim (and
    # num_key_value_heads is 1). 0: ordinary attention.
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rotary over interleaved pairs of dimensions (DeepSeek)
    # A *ForSequenceClassification checkpoint (its family's decoder, then a `score` head from the
    # last hidden state to this many label logits, and no LM head); 0: a causal LM.
    num_labels: int = 0
    # Hybrid models (model/hybrid.py): each layer's kind, "full_attention" or "linear_attention" (a
    # Gated DeltaNet, model/gated_deltanet.py, which keeps a fixed-size recurrent state per request
    # instead of keys and values); None: every layer attends. The linear layers' sizes follow.
    layer_types: tuple[str, ...] | None = None
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # Granite 4's hybrids: their "linear_attention" layers are Mamba2 (model/mamba2.py), of these
    # sizes; dt is clamped to mamba_time_step_limit.
    mamba_n_heads: int = 0
    mamba_d_head: int = 0
    mamba_n_groups: int = 1
    mamba_d_state: int = 0
    mamba_d_conv: int = 0
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_time_step_limit: tuple[float, float] = (0.0, float("inf"))
    # Granite's scalings: embeddings times embedding_multiplier, each layer's attention (or mixer)
    # and MLP outputs times residual_multiplier before they join the residual stream, attention
    # scores times attention_multiplier (not head_dim ** -0.5), logits divided by logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    use_rope: bool = True  # False: no position embedding at all (Granite 4's "nope")

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"unsupported hidden activation {self.hidden_act!r}; "
                f"supported: {', '.join(ACTIVATIONS)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        self.rope_scaling = _check_rope_scaling(self.rope_scaling)
        # A rotary width the heads cannot hold loaded, then failed every request's step.
        if not (0 < self.partial_rotary_factor <= 1 and self.rotary_dim >= 2 and self.rotary_dim % 2 == 0):
            raise ModelLoadError(
                f"the rotary dimension, head_dim {self.head_dim} x partial_rotary_factor "
                f"{self.partial_rotary_factor:g} = {self.head_dim * self.partial_rotary_factor:g}, must be "
                f"an even number from 2 to head_dim (GGUF: rope.dimension_count)")
        if self.layer_types is not None:
            _check_layer_types(self.layer_types, self.num_hidden_layers)
        if self.num_experts and not (isinstance(self.num_experts_per_tok, int)
                                     and 0 < self.num_experts_per_tok <= self.num_experts):
            raise UnsupportedModelError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                f"num_experts={self.num_experts}")

    @property
    def rope_type(self) -> str:
        return self.rope_scaling["rope_type"] if self.rope_scaling else "default"

    @property
    def arch(self) -> Architecture:
        """What this model's family changes in the Llama decoder."""
        return ARCHITECTURES[self.architecture]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def uses_sliding_window(self, layer_index: int) -> bool:
        return self.sliding_window is not None and (
            self.sliding_layers is None or layer_index in self.sliding_layers)

    def layer_window(self, layer_index: int) -> int | None:
        """How far back layer layer_index attends, in tokens (None: to the first token)."""
        return self.sliding_window if self.uses_sliding_window(layer_index) else None

    @property
    def kv_window(self) -> int | None:
        """The window of every layer at once: keys further back than this are read by no layer,
        so the KV manager may give their blocks back as a request advances. None where any layer
        attends to everything (Gemma's global layers, Qwen2's layers below max_window_layers)."""
        windows = [self.layer_window(i) for i in range(self.num_hidden_layers)]
        return None if None in windows else max(windows)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that keep keys and values in the paged cache (every one but a hybrid's
        recurrent layers), in order: the runner allocates a KV cache for each."""
        if self.layer_types is None:
            return tuple(range(self.num_hidden_layers))
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "full_attention")

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers keep a recurrent state per request instead of keys and values."""
        return len(self.attention_layers) < self.num_hidden_layers

    def is_moe_layer(self, layer_index: int) -> bool:
        return self.num_experts > 0 and (self.moe_layers is None or layer_index in self.moe_layers)

    def uses_local_rope(self, layer_index: int) -> bool:
        return self.local_rope_theta is not None and self.uses_sliding_window(layer_index)

    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelConfig:
        """From config.json (and generation_config.json, whose eos ids extend the config's)."""
        missing = [key for key in _REQUIRED_HF_KEYS if key not in config]
        if missing:
            raise ModelLoadError(f"config.json lacks required keys: {', '.join(missing)}")
        _check_sizes(config, "config.json", {key: key for key in (
            *_REQUIRED_HF_KEYS, "num_key_value_heads", "head_dim", "max_position_embeddings")})
        _check_numbers(config, "config.json", ("rms_norm_eps", "rope_theta"))
        architecture, num_labels = _hf_architecture(config)
        arch = ARCHITECTURES[architecture]
        heads = config["num_attention_heads"]
        rope_theta, rope_scaling, local_rope_theta = _hf_rope(config, arch)
        attention_bias = bool(config.get("attention_bias", False))
        if config.get("use_bidirectional_attention"):
            raise UnsupportedModelError("bidirectional attention (an embedding model) is not supported")
        window, sliding_layers = _hf_sliding_window(config, arch)
        eos_ids = _as_id_list(config.get("eos_token_id"))
        if generation_config:
            eos_ids += [i for i in _as_id_list(generation_config.get("eos_token_id"))
                        if i not in eos_ids]
        fields = dict(
            architecture=architecture,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            # A classifier has no LM head: tied, nothing more is looked for (and none is used).
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)) or num_labels > 0,
            num_labels=num_labels,
            attention_bias=arch.qkv_bias or attention_bias,
            output_bias=attention_bias and not arch.qkv_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=parse_dtype_name(config.get("dtype") or config.get("torch_dtype") or "float32"),
            sliding_window=window,
            sliding_layers=sliding_layers,
            # Gemma names it hidden_activation (and may carry a stale hidden_act beside it).
            hidden_act=config.get("hidden_activation") or config.get("hidden_act") or arch.hidden_act,
            query_pre_attn_scalar=config.get("query_pre_attn_scalar"),
            attn_logit_softcapping=config.get("attn_logit_softcapping"),
            final_logit_softcapping=config.get("final_logit_softcapping"),
            local_rope_theta=local_rope_theta,
            partial_rotary_factor=_hf_partial_rotary_factor(config),
        )
        # A latent-attention model's cache geometry replaces the heads' (config_parts.py).
        return cls(**{**fields, **hf_sparse_and_latent_fields(config, architecture)})

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
        """From GGUF key/value metadata (llama.cpp's key names) and the names of its tensors."""
        gguf_arch = metadata["general.architecture"]
        if gguf_arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported GGUF architecture {gguf_arch!r}; "
                f"supported: {', '.join(GGUF_ARCHITECTURES)}")
        architecture = GGUF_ARCHITECTURES[gguf_arch]
        if gguf_arch == "llama" and metadata.get("llama.expert_count"):
            architecture = "MixtralForCausalLM"  # llama.cpp writes Mixtral as a Llama with experts
        if gguf_arch == "deepseek2" and metadata.get("deepseek2.expert_gating_func") == SIGMOID_GATING:
            architecture = "DeepseekV3ForCausalLM"
        arch = ARCHITECTURES[architecture]

        # A hybrid's head_count_kv is per layer, 0 on its recurrent layers.
        kv_per_layer = metadata.get(f"{gguf_arch}.attention.head_count_kv")
        if isinstance(kv_per_layer, list):
            metadata = {**metadata, f"{gguf_arch}.attention.head_count_kv": max(kv_per_layer, default=0)}

        def key(name: str, default: Any = None) -> Any:
            default = _LLAMA_CPP_DEFAULTS.get(gguf_arch, {}).get(name, default)
            return metadata.get(f"{gguf_arch}.{name}", default)

        _check_sizes(metadata, "the GGUF metadata", {f"{gguf_arch}.{name}": name for name in (
            "attention.head_count", "embedding_length", "block_count", "feed_forward_length",
            "attention.head_count_kv", "attention.key_length", "context_length", "vocab_size")})
        _check_numbers(metadata, "the GGUF metadata", (
            f"{gguf_arch}.attention.layer_norm_rms_epsilon", f"{gguf_arch}.rope.freq_base"))

        heads = key("attention.head_count")
        hidden = key("embedding_length")
        head_dim = key("attention.key_length") or hidden // heads
        layers = key("block_count")
        eos_ids = [metadata[k] for k in ("tokenizer.ggml.eos_token_id",
                                         "tokenizer.ggml.eot_token_id",
                                         "tokenizer.ggml.eom_token_id") if k in metadata]
        window, sliding_layers = _gguf_sliding_window(key, arch, layers)
        fields = dict(
            architecture=architecture,
            vocab_size=key("vocab_size") or len(metadata["tokenizer.ggml.tokens"]),
            hidden_size=hidden,
            intermediate_size=key("feed_forward_length"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=key("attention.head_count_kv") or heads,
            head_dim=head_dim,
            rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=key("rope.freq_base", 10000.0),
            rope_scaling=_gguf_rope_scaling(key, arch),
            max_position_embeddings=key("context_length", 2048),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            output_bias="blk.0.attn_output.bias" in tensor_names,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=list(dict.fromkeys(eos_ids)),
            dtype=_GGUF_FILE_DTYPES.get(metadata.get("general.file_type", 0), torch.float32),
            sliding_window=window,
            sliding_layers=sliding_layers,
            hidden_act=arch.hidden_act,
            query_pre_attn_scalar=_gguf_query_pre_attn_scalar(
                gguf_arch, hidden, heads, head_dim, layers),
            attn_logit_softcapping=key("attn_logit_softcapping"),
            final_logit_softcapping=key("final_logit_softcapping"),
            local_rope_theta=key("rope.freq_base_swa", arch.local_rope_theta),
            partial_rotary_factor=key("rope.dimension_count", head_dim) / head_dim,
            **gguf_moe_fields(key, tensor_names, layers, architecture),
        )
        if gguf_arch == "deepseek2":
            fields.update(gguf_latent_fields(key))
        if gguf_arch == "granitehybrid":
            fields.update(gguf_granite_hybrid_fields(key, tensor_names, kv_per_layer))
        return cls(**fields)


# The largest value a size may have: token ids and tensor dimensions are int32-sized, and a larger
# value in a config is damage, not a model.
_MAX_SIZE = 2**31 - 1


def _check_sizes(values: dict[str, Any], source: str, names: dict[str, str]) -> None:
    """ModelLoadError, in one line, for the first size (by its key in values) present and not a
    positive integer within _MAX_SIZE; names maps each key to the name the message uses."""
    for key, name in names.items():
        value = values.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_SIZE:
            raise ModelLoadError(f"{source}: {name} must be a positive integer (at most "
                                 f"{_MAX_SIZE}); got {value!r}")


def _check_numbers(values: dict[str, Any], source: str, keys: tuple[str, ...]) -> None:
    """ModelLoadError for the first of keys present and not a positive finite number."""
    for key in keys:
        value = values.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ModelLoadError(f"{source}: {key} must be a positive number; got {value!r}")


def parse_dtype_name(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a name in pagedllm.config's dtype table ("bfloat16", "half", ...)."""
    if isinstance(name, torch.dtype):
        return name
    try:
        canonical = canonical_dtype(name)
    except ValueError:
        canonical = None
    if canonical in (None, "auto"):
        raise UnsupportedModelError(f"unsupported dtype {name!r}; supported: "
                                    f"{', '.join(d for d in DTYPES if d != 'auto')}")
    return getattr(torch, canonical)


_REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads")


def _hf_architecture(config: dict[str, Any]) -> tuple[str, int]:
    """The family's causal-LM architecture, and a sequence classifier's number of labels (0: a
    causal LM): Qwen3ForSequenceClassification is Qwen3ForCausalLM's decoder with a score head."""
    architectures = config.get("architectures") or []
    if not architectures:
        raise UnsupportedModelError(
            "config.json names no architecture (the 'architectures' list is missing or empty)")
    name, num_labels = architectures[0], 0
    if name.endswith("ForSequenceClassification"):
        name = name.removesuffix("ForSequenceClassification") + "ForCausalLM"
        num_labels = len(config.get("id2label") or {}) or config.get("num_labels") or 2
    if name not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise UnsupportedModelError(
            f"unsupported architecture {architectures[0]!r}; supported: {supported}, and their "
            "*ForSequenceClassification classifiers")
    return name, num_labels


def _hf_rope(
    config: dict[str, Any], arch: Architecture
) -> tuple[float, dict[str, Any] | None, float | None]:
    """(rope_theta, rope_scaling, local_rope_theta) from the older keys or the newer
    rope_parameters, which Gemma 3 splits by layer type."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    local_theta = config.get("rope_local_base_freq")
    if "full_attention" in params:
        local_theta = (params.get("sliding_attention") or {}).get("rope_theta", local_theta)
        params = dict(params["full_attention"] or {})
    theta = params.pop("rope_theta", None) or config.get("rope_theta", 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    params.pop("partial_rotary_factor", None)  # read by _hf_partial_rotary_factor
    rope_type = {"su": "longrope"}.get(rope_type, rope_type)  # Phi-3's older name for it
    if local_theta is None:
        local_theta = arch.local_rope_theta
    if rope_type == "default":
        return float(theta), None, local_theta
    if rope_type in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings",
                          config.get("original_max_position_embeddings")
                          or config.get("max_position_embeddings", 2048))
    if rope_type == "yarn" and params.get("factor") is None:  # stretched from the original length
        params["factor"] = (config.get("max_position_embeddings", 2048)
                            / params["original_max_position_embeddings"])
    return float(theta), {"rope_type": rope_type, **params}, local_theta


def _hf_partial_rotary_factor(config: dict[str, Any]) -> float:
    params = config.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0)


def _hf_sliding_window(
    config: dict[str, Any], arch: Architecture
) -> tuple[int | None, tuple[int, ...] | None]:
    """(window, the layers that use it; None: all) from layer_types, which transformers writes,
    or from each family's older keys."""
    window = config.get("sliding_window") if arch.sliding_window else None
    num_layers = config["num_hidden_layers"]
    if not window or ("use_sliding_window" in config and not config["use_sliding_window"]):
        return None, None
    if config.get("layer_types"):
        return window, tuple(i for i, kind in enumerate(config["layer_types"])
                             if kind == "sliding_attention")
    if "use_sliding_window" in config:  # Qwen2/Qwen3: the layers from max_window_layers on
        return window, tuple(range(config.get("max_window_layers", 28), num_layers))
    return window, _periodic_sliding_layers(
        config.get("sliding_window_pattern") or arch.sliding_period, num_layers)


def _periodic_sliding_layers(period: int | None, num_layers: int) -> tuple[int, ...] | None:
    """Every layer but each period-th one (None: every layer)."""
    if period is None:
        return None
    return tuple(i for i in range(num_layers) if (i + 1) % period)


def _gguf_sliding_window(
    key, arch: Architecture, num_layers: int
) -> tuple[int | None, tuple[int, ...] | None]:
    window = key("attention.sliding_window")
    if not window:
        return None, None
    pattern = key("attention.sliding_window_pattern", arch.sliding_period)
    if isinstance(pattern, list):  # one flag per layer
        return window, tuple(i for i, sliding in enumerate(pattern) if sliding)
    return window, _periodic_sliding_layers(pattern, num_layers)


# What llama.cpp assumes where a file of that architecture is silent.
_LLAMA_CPP_DEFAULTS = {
    "gemma2": {"attention.sliding_window": 4096, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0},
    # DeepSeek's converter writes expert_weights_norm only where it is true.
    "deepseek2": {"expert_weights_norm": False},
    "qwen2moe": {"expert_weights_norm": False},  # its graph never renormalizes the top-k scores
}

# GGUF files do not store Gemma's query_pre_attn_scalar. llama.cpp knows it is head_dim for every
# size but the 27B one, told apart by its layer count, which uses hidden_size / heads.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gguf_query_pre_attn_scalar(
    gguf_arch: str, hidden: int, heads: int, head_dim: int, layers: int
) -> int | None:
    if gguf_arch not in _GEMMA_27B_LAYERS:
        return None
    return hidden // heads if layers == _GEMMA_27B_LAYERS[gguf_arch] else head_dim


def _gguf_rope_scaling(key, arch: Architecture) -> dict[str, Any] | None:
    rope_type = key("rope.scaling.type", "none")
    if rope_type == "none":
        return None
    scaling = {"rope_type": rope_type, "factor": key("rope.scaling.factor", 1.0)}
    if key("rope.scaling.original_context_length"):
        scaling["original_max_position_embeddings"] = key("rope.scaling.original_context_length")
    if rope_type == "yarn":
        scaling.update(beta_fast=key("rope.scaling.yarn_beta_fast"),
                       beta_slow=key("rope.scaling.yarn_beta_slow"), truncate=arch.yarn_truncate)
    return scaling


def _check_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope scaling type {rope_type!r}; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    required = {"linear": ["factor"], "dynamic": ["factor"],
                "llama3": ["factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings"],
                "yarn": ["factor", "original_max_position_embeddings"],
                "longrope": ["short_factor", "long_factor", "original_max_position_embeddings"],
                }.get(rope_type, [])
    missing = [name for name in required if name not in scaling]
    if missing:
        raise UnsupportedModelError(f"{rope_type} rope scaling lacks {', '.join(missing)}")
    return None if rope_type == "default" else dict(scaling)


# The layer kinds a hybrid model may mix (model/hybrid.py builds each).
LAYER_KINDS = ("full_attention", "linear_attention")


def _check_layer_types(layer_types: tuple[str, ...], num_layers: int) -> None:
    if len(layer_types) != num_layers:
        raise ModelLoadError(f"layer_types names {len(layer_types)} layers; the model has {num_layers}")
    unknown = sorted(set(layer_types) - set(LAYER_KINDS))
    if unknown:
        raise UnsupportedModelError(f"unsupported layer kinds {', '.join(unknown)}; supported: "
                                    f"{', '.join(LAYER_KINDS)}")
    if "full_attention" not in layer_types:
        raise UnsupportedModelError("a hybrid model without any full_attention layer is not supported "
                                    "(its recurrent states are held in the attention layers' pages)")


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]
