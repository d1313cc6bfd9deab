"""A PEFT LoRA adapter read from its folder (adapter_config.json + adapter_model.safetensors) and
checked against the base model, each refusal one line that names the adapter.

An adapter adds (alpha / r) * B @ A to some of the base's projections. Ours are fused (q/k/v in one
qkv_proj, gate/up in one gate_up_proj), so each of the adapter's projections lands on a row range
of one fused module: PART_OF says which, and the manager writes A and B there (lora/layers.py
explains the layout). Supported: plain LoRA (and rsLoRA's alpha / sqrt(r)) on q, k, v, o, gate,
up and down, the embeddings and the LM head (held under layer -1); DoRA, LoRA biases,
modules_to_save and trainable tokens are refused. PEFT saves the base's embedding and head
weights beside an adapter that targets them (save_embedding_layers, on by default then): LoRA
keeps those frozen, so they are the base's own and are not read (as vLLM does), unless their
shape says the vocabulary was resized, which is refused.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedllm.model.config import ModelConfig

# An adapter's module name -> (our fused module under each layer, which part of it).
PART_OF = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
    "embed_tokens": ("embed_tokens", 0), "lm_head": ("lm_head", 0),
}
MODEL_WIDE = -1  # the "layer" of the embeddings and the LM head
LAYER_MODULES = tuple(name for name in PART_OF if name not in ("embed_tokens", "lm_head"))
_KEY = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_VOCAB_KEY = re.compile(r"(?:base_model\.model\.)?(?:model\.(embed_tokens)\.lora_embedding_([AB])"
                        r"|(lm_head)\.lora_([AB])\.weight)")
_BASE_COPY = re.compile(r"(?:base_model\.model\.)?(?:model\.)?(embed_tokens|lm_head)\.base_layer\.weight")


class LoRAError(ValueError):
    """An adapter that cannot be served, said in one line naming it."""


@dataclass
class LoRAAdapter:
    name: str
    rank: int
    scaling: float
    # (layer, adapter module name) -> (A [r, in], B [out, r]), float32 (the embeddings': A
    # [r, vocab], B [hidden, r]; they and the head under MODEL_WIDE).
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def load(cls, name: str, path: str | Path, base: ModelConfig, max_rank: int) -> LoRAAdapter:
        folder = Path(path).expanduser()
        config = _read_config(name, folder)
        rank = config.get("r")
        if not isinstance(rank, int) or rank < 1:
            raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json has no valid rank r ({rank!r})")
        if rank > max_rank:
            raise LoRAError(f"LoRA adapter {name!r}: rank {rank} exceeds --max-lora-rank {max_rank}")
        for key, what in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save"),
                          ("trainable_token_indices", "trainable_token_indices")):
            if config.get(key):
                raise LoRAError(f"LoRA adapter {name!r}: {what} is not supported")
        if config.get("bias", "none") != "none" or config.get("lora_bias"):
            raise LoRAError(f"LoRA adapter {name!r}: LoRA biases are not supported")
        if config.get("rank_pattern") or config.get("alpha_pattern"):
            raise LoRAError(f"LoRA adapter {name!r}: per-module ranks or alphas are not supported")
        alpha = config.get("lora_alpha", rank)
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        adapter = cls(name, rank, scaling)
        for key, tensor in _read_tensors(name, folder).items():
            adapter._add(key, tensor, base)
        if not adapter.weights:
            raise LoRAError(f"LoRA adapter {name!r}: no LoRA weights for q/k/v/o/gate/up/down projections, "
                            "the embeddings or the LM head")
        adapter._check_pairs()
        return adapter

    def _add(self, key: str, tensor: torch.Tensor, base: ModelConfig) -> None:
        copy = _BASE_COPY.fullmatch(key)
        if copy is not None:
            want = (base.vocab_size, base.hidden_size)
            if tuple(tensor.shape) != want:
                raise LoRAError(f"LoRA adapter {self.name!r}: tensor {key} has shape {tuple(tensor.shape)}, "
                                f"the base model's is {want} (a resized vocabulary is not supported)")
            return  # the base's own weight (LoRA trains beside it), not read
        vocab = _VOCAB_KEY.fullmatch(key)
        match = _KEY.fullmatch(key)
        if vocab is not None:
            layer, module, side = MODEL_WIDE, vocab[1] or vocab[3], vocab[2] or vocab[4]
        elif match is None or match[2] not in LAYER_MODULES:
            raise LoRAError(f"LoRA adapter {self.name!r}: tensor {key} targets a module this base "
                            f"model has no LoRA slot for (supported: {', '.join(PART_OF)})")
        else:
            layer, module, side = int(match[1]), match[2], match[3]
        if layer >= base.num_hidden_layers or module.endswith(
                ("gate_proj", "up_proj", "down_proj")) and base.is_moe_layer(layer):
            raise LoRAError(f"LoRA adapter {self.name!r}: tensor {key} targets a module the base "
                            "model does not have")
        out_features, in_features = projection_shape(base, module)
        want = (self.rank, in_features) if side == "A" else (out_features, self.rank)
        if tuple(tensor.shape) != want:
            raise LoRAError(f"LoRA adapter {self.name!r}: tensor {key} has shape {tuple(tensor.shape)}, "
                            f"the base model needs {want} (an adapter for another base model?)")
        pair = list(self.weights.get((layer, module), (None, None)))
        pair[0 if side == "A" else 1] = tensor.float()
        self.weights[(layer, module)] = tuple(pair)

    def _check_pairs(self) -> None:
        for (layer, module), (a, b) in self.weights.items():
            if a is None or b is None:
                where = module if layer == MODEL_WIDE else f"layer {layer} {module}"
                raise LoRAError(f"LoRA adapter {self.name!r}: {where} has lora_"
                                f"{'A' if a is None else 'B'} missing")


def projection_shape(base: ModelConfig, module: str) -> tuple[int, int]:
    """(out_features, in_features) of one unfused projection of the base model."""
    hidden, q_size = base.hidden_size, base.num_attention_heads * base.head_dim
    kv_size = base.num_key_value_heads * base.head_dim
    return {"q_proj": (q_size, hidden), "k_proj": (kv_size, hidden), "v_proj": (kv_size, hidden),
            "o_proj": (hidden, q_size), "gate_proj": (base.intermediate_size, hidden),
            "up_proj": (base.intermediate_size, hidden),
            "down_proj": (hidden, base.intermediate_size),
            # The embeddings map a token (of vocab) to hidden, as PEFT shapes their A and B.
            "embed_tokens": (hidden, base.vocab_size), "lm_head": (base.vocab_size, hidden)}[module]


def _read_config(name: str, folder: Path) -> dict:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: {folder} has no adapter_config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAError(f"LoRA adapter {name!r}: {path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: {path} is not a LoRA adapter's config")
    return config


def _read_tensors(name: str, folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: {folder} has no adapter_model.safetensors")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {path} ({exc}); it is damaged") from None
