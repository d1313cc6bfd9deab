"""The shape of a Llama-family model, read from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.model.errors import ModelLoadError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
# GGUF's general.architecture -> the Hugging Face class it stands for.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_DTYPE_NAMES = {
    "float32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16,
}
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
    # Keys further back than this are not attended to, on layers >= first_sliding_layer.
    sliding_window: int | None = None
    first_sliding_layer: int = 0

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        self.rope_scaling = _check_rope_scaling(self.rope_scaling)

    @property
    def rope_type(self) -> str:
        return self.rope_scaling["rope_type"] if self.rope_scaling else "default"

    def uses_sliding_window(self, layer_index: int) -> bool:
        return self.sliding_window is not None and layer_index >= self.first_sliding_layer

    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelConfig:
        """From config.json (and generation_config.json, whose eos ids extend the config's)."""
        missing = [key for key in _REQUIRED_HF_KEYS if key not in config]
        if missing:
            raise ModelLoadError(f"config.json lacks required keys: {', '.join(missing)}")
        architecture = _hf_architecture(config)
        heads = config["num_attention_heads"]
        rope_theta, rope_scaling = _hf_rope(config)
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = bool(config.get("attention_bias", False))
        if config.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {config['hidden_act']!r}")
        window, first_window_layer = _hf_sliding_window(config, architecture)
        eos_ids = _as_id_list(config.get("eos_token_id"))
        if generation_config:
            eos_ids += [i for i in _as_id_list(generation_config.get("eos_token_id"))
                        if i not in eos_ids]
        return cls(
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
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or attention_bias,
            output_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(config.get("mlp_bias", False)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=parse_dtype_name(config.get("dtype") or config.get("torch_dtype") or "float32"),
            sliding_window=window,
            first_sliding_layer=first_window_layer,
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
        """From GGUF key/value metadata (llama.cpp's key names) and the names of its tensors."""
        arch = metadata["general.architecture"]
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported GGUF architecture {arch!r}; "
                f"supported: {', '.join(GGUF_ARCHITECTURES)}")

        def key(name: str, default: Any = None) -> Any:
            return metadata.get(f"{arch}.{name}", default)

        heads = key("attention.head_count")
        hidden = key("embedding_length")
        eos_ids = [metadata[k] for k in ("tokenizer.ggml.eos_token_id",
                                         "tokenizer.ggml.eot_token_id",
                                         "tokenizer.ggml.eom_token_id") if k in metadata]
        return cls(
            architecture=GGUF_ARCHITECTURES[arch],
            vocab_size=key("vocab_size") or len(metadata["tokenizer.ggml.tokens"]),
            hidden_size=hidden,
            intermediate_size=key("feed_forward_length"),
            num_hidden_layers=key("block_count"),
            num_attention_heads=heads,
            num_key_value_heads=key("attention.head_count_kv") or heads,
            head_dim=key("attention.key_length") or hidden // heads,
            rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=key("rope.freq_base", 10000.0),
            rope_scaling=_gguf_rope_scaling(key),
            max_position_embeddings=key("context_length", 2048),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            output_bias="blk.0.attn_output.bias" in tensor_names,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=list(dict.fromkeys(eos_ids)),
            dtype=_GGUF_FILE_DTYPES.get(metadata.get("general.file_type", 0), torch.float32),
        )


def parse_dtype_name(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPE_NAMES[name.removeprefix("torch.")]
    except KeyError:
        raise UnsupportedModelError(
            f"unsupported dtype {name!r}; supported: {', '.join(_DTYPE_NAMES)}") from None


_REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads")


def _hf_architecture(config: dict[str, Any]) -> str:
    architectures = config.get("architectures") or []
    if not architectures:
        raise UnsupportedModelError(
            "config.json names no architecture (the 'architectures' list is missing or empty)")
    if architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {architectures[0]!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return architectures[0]


def _hf_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the old keys or the newer rope_parameters."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or config.get("rope_theta", 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings",
                          config.get("max_position_embeddings", 2048))
    return float(theta), {"rope_type": rope_type, **params}


def _hf_sliding_window(config: dict[str, Any], architecture: str) -> tuple[int | None, int]:
    if architecture == "MistralForCausalLM":
        return config.get("sliding_window"), 0
    if architecture == "Qwen2ForCausalLM" and config.get("use_sliding_window"):
        return config.get("sliding_window"), config.get("max_window_layers", 28)
    return None, 0


def _gguf_rope_scaling(key) -> dict[str, Any] | None:
    rope_type = key("rope.scaling.type", "none")
    if rope_type == "none":
        return None
    scaling = {"rope_type": rope_type, "factor": key("rope.scaling.factor", 1.0)}
    if key("rope.scaling.original_context_length"):
        scaling["original_max_position_embeddings"] = key("rope.scaling.original_context_length")
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
                           "original_max_position_embeddings"]}.get(rope_type, [])
    missing = [name for name in required if name not in scaling]
    if missing:
        raise UnsupportedModelError(f"{rope_type} rope scaling lacks {', '.join(missing)}")
    return None if rope_type == "default" else dict(scaling)


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]
