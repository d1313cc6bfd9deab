"""Reading a llama.cpp GGUF file: metadata, and tensors under Hugging Face names (dequantized, or
repacked quantized by gguf_repack), with what llama.cpp's converter changed in them undone (the
q/k row order of Llama, Gemma's norm offset).

gpt-oss's files (general.architecture "gpt-oss"): its sinks are attn_sinks.weight, its router
ffn_gate_inp (weight and bias), its experts ffn_{gate,up,down}_exps stacked (weights, typically
MXFP4, and biases), the gate and up columns llama.cpp's converter split out of transformers'
interleaved gate_up_proj; they come out under the per-expert names gpt_oss.py gives a Hugging Face
folder's.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from pagedllm.model.config import ModelConfig
from pagedllm.model.errors import CorruptCheckpointError, UnsupportedModelError
from pagedllm.model.gguf_repack import REPACKERS, repack
from pagedllm.model.quant_weight import QuantizedWeight

Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
    Q.Q6_K, Q.IQ4_NL, Q.MXFP4})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Per GGUF architecture where its layer tensors are named otherwise.
_ARCH_LAYER_NAMES = {
    "gemma2": _GEMMA_LAYER_NAMES,
    "gemma3": _GEMMA_LAYER_NAMES,
    # Phi-3 keeps q/k/v and gate/up fused; llama.cpp calls the fused gate/up ffn_up.
    "phi3": {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # Qwen2-MoE's shared expert and its gate (one output, stored [1, hidden]).
    "qwen2moe": {**_LAYER_NAMES, "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                 "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
                 "ffn_gate_inp_shexp": "mlp.shared_expert_gate"},
    "gpt-oss": {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm"},
}
# Tensors transformers names without a .weight suffix: GGUF name part -> the name's end.
_BARE_NAMES = {"attn_sinks": "self_attn.sinks"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# A mixture of experts: llama.cpp stacks each layer's experts in one [E, rows, columns] tensor per
# projection; transformers names each expert's own. Where each GGUF architecture's live, and the
# Hugging Face names of its router and of an expert's gate, up and down projections.
_EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)")
_QWEN_EXPERTS = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
# (the layer's module, its router's name, the experts' projections)
_MOE_NAMES = {
    "qwen3moe": ("mlp", "gate", _QWEN_EXPERTS),
    "qwen2moe": ("mlp", "gate", _QWEN_EXPERTS),
    "llama": ("block_sparse_moe", "gate", {"gate": "w1", "up": "w3", "down": "w2"}),  # Mixtral
    "gpt-oss": ("mlp", "router", _QWEN_EXPERTS),
}


class GGUFCheckpoint:
    """An open GGUF file: its metadata as plain Python values, and its tensors on demand."""

    def __init__(self, path: Path):
        self.path = path
        with path.open("rb") as file:
            if file.read(4) != b"GGUF":
                raise CorruptCheckpointError(f"{path}: not a GGUF file (no GGUF magic number)")
        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as exc:  # the reader fails in many ways on a cut-off file
            raise CorruptCheckpointError(
                f"{path}: cannot read the GGUF file ({type(exc).__name__}: {exc}); "
                "it is truncated or damaged") from None
        self._check_complete()
        self.metadata = {name: field.contents() for name, field in self.reader.fields.items()}
        self.architecture = self.metadata.get("general.architecture")
        self.tensors = {t.name: t for t in self.reader.tensors}
        # Hugging Face name -> GGUF name, for the tensors we know; an expert's names -> the
        # stacked tensor it is cut from, and its index there.
        self.hf_names = {hf: name for name in self.tensors
                         if (hf := hf_name(name, self.architecture)) is not None}
        self.expert_index: dict[str, int] = {}
        for name, tensor in self.tensors.items():
            for expert, hf in enumerate(expert_hf_names(name, self.architecture, int(tensor.shape[-1]))):
                self.hf_names[hf] = name
                self.expert_index[hf] = expert

    @staticmethod
    def holds_quantized_tensors(path: Path) -> bool:
        """Whether the GGUF at path stores any tensor in a quantized type (not F32, F16 or BF16),
        read from its header alone."""
        kinds = gguf.GGMLQuantizationType
        floats = {kinds.F32, kinds.F16, kinds.BF16}
        return any(t.tensor_type not in floats for t in gguf.GGUFReader(path).tensors)

    def _check_complete(self) -> None:
        file_size = self.path.stat().st_size
        for tensor in self.reader.tensors:
            end = tensor.data_offset + tensor.n_bytes
            if end > file_size or tensor.data.nbytes < tensor.n_bytes:
                raise CorruptCheckpointError(
                    f"{self.path}: truncated: tensor {tensor.name} ends at byte {end} "
                    f"but the file has {file_size} bytes")

    def model_config(self) -> ModelConfig:
        config = ModelConfig.from_gguf_metadata(self.metadata, set(self.tensors))
        longrope = self._longrope_scaling()
        return dataclasses.replace(config, rope_scaling=longrope) if longrope else config

    def _longrope_scaling(self) -> dict[str, Any] | None:
        """Phi-3's LongRoPE: its factors are tensors, the rest metadata."""
        if "rope_factors_long.weight" not in self.tensors:
            return None
        scaling = {
            "rope_type": "longrope",
            "short_factor": self.get_raw("rope_factors_short.weight").tolist(),
            "long_factor": self.get_raw("rope_factors_long.weight").tolist(),
            "original_max_position_embeddings":
                self.metadata.get(f"{self.architecture}.rope.scaling.original_context_length"),
        }
        attention_factor = self.metadata.get(f"{self.architecture}.rope.scaling.attn_factor")
        if attention_factor is not None:
            scaling["attention_factor"] = attention_factor
        return scaling

    def check_types(self) -> None:
        """Refuse unsupported quantizations before spending time on the others."""
        for tensor in self.tensors.values():
            if tensor.tensor_type not in SUPPORTED_TYPES:
                raise UnsupportedModelError(
                    f"{self.path}: tensor {tensor.name} uses quantization type "
                    f"{tensor.tensor_type.name}, which is not supported; supported: "
                    f"{', '.join(sorted(t.name for t in SUPPORTED_TYPES))}")

    def get_hf_tensor(self, hf: str, keep_quantized: bool = False) -> torch.Tensor | QuantizedWeight:
        """The tensor stored for Hugging Face name hf, in the row order transformers uses:
        dequantized to float32, or (keep_quantized) repacked quantized where gguf_repack can."""
        name, expert = self.hf_names[hf], self.expert_index.get(hf)
        if keep_quantized and self.can_repack(name):
            weights = self.get_repacked(name, expert)
        else:
            weights = self.get_raw(name, expert)
        undo = _CONVERTER_CHANGES.get(self.architecture)
        return weights if undo is None else undo(weights, name, self.metadata)

    def can_repack(self, name: str) -> bool:
        tensor = self.tensors[name]
        return tensor.tensor_type in REPACKERS and len(tensor.shape) in (2, 3)

    def get_repacked(self, name: str, expert: int | None = None) -> QuantizedWeight:
        """The weight kept quantized; of a stacked experts tensor, expert's own rows only."""
        tensor = self.tensors[name]
        in_features, out_features = (int(d) for d in tensor.shape[:2])
        data = tensor.data if expert is None else tensor.data[expert]
        return repack(tensor.tensor_type, data, (out_features, in_features))

    def rope_freq_factors(self) -> torch.Tensor | None:
        """Llama 3.1 files carry their rope scaling as per-frequency divisors, not metadata."""
        return self.get_raw("rope_freqs.weight") if "rope_freqs.weight" in self.tensors else None

    def get_raw(self, name: str, expert: int | None = None) -> torch.Tensor:
        """Dequantized to float32; of a stacked experts tensor, expert's own rows only."""
        tensor = self.tensors[name]
        data = tensor.data if expert is None else tensor.data[expert]
        data = np.asarray(gguf.quants.dequantize(data, tensor.tensor_type), np.float32)
        if not data.flags.writeable:  # float32 tensors come back as views of the memory map
            data = data.copy()
        return torch.from_numpy(np.ascontiguousarray(data))


def hf_name(gguf_name: str, architecture: str | None = "llama") -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    layer_names = _ARCH_LAYER_NAMES.get(architecture, _LAYER_NAMES)
    if architecture in _MOE_NAMES:  # the router of a mixture of experts
        module, router, _ = _MOE_NAMES[architecture]
        layer_names = {**layer_names, "ffn_gate_inp": f"{module}.{router}"}
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is not None and match[2] in _BARE_NAMES and match[3] == "weight":
        return f"model.layers.{match[1]}.{_BARE_NAMES[match[2]]}"
    if match is None or match[2] not in layer_names:
        return None
    return f"model.layers.{match[1]}.{layer_names[match[2]]}.{match[3]}"


def expert_hf_names(gguf_name: str, architecture: str | None, num_experts: int) -> list[str]:
    """The Hugging Face names of each expert cut from a stacked experts tensor ([] otherwise)."""
    match = _EXPERT_TENSOR.fullmatch(gguf_name)
    if match is None or architecture not in _MOE_NAMES:
        return []
    prefix, _, projections = _MOE_NAMES[architecture]
    layer, projection, kind = match[1], projections[match[2]], match[3]
    return [f"model.layers.{layer}.{prefix}.experts.{e}.{projection}.{kind}" for e in range(num_experts)]


def _undo_rotary_permutation(
    weights: torch.Tensor | QuantizedWeight, name: str, metadata: dict[str, Any]
) -> torch.Tensor | QuantizedWeight:
    """llama.cpp's converter reorders q/k rows per head from the two-halves rotary layout to
    interleaved pairs (row j of half h goes to 2j+h). Put them back in halves."""
    if ".attn_q." in name:
        heads = metadata["llama.attention.head_count"]
    elif ".attn_k." in name:
        heads = metadata.get("llama.attention.head_count_kv") or \
            metadata["llama.attention.head_count"]
    else:
        return weights
    rows = weights.shape[0]
    order = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)
    if isinstance(weights, QuantizedWeight):
        return weights.select_rows(order)
    return weights.index_select(0, order)


def _undo_norm_offset(weights: torch.Tensor, name: str, metadata: dict[str, Any]) -> torch.Tensor:
    """Gemma's RMSNorm scales by (1 + weight); llama.cpp's converter stores 1 + weight."""
    return weights - 1 if name.endswith("norm.weight") else weights


def _shared_gate_as_a_row(
    weights: torch.Tensor | QuantizedWeight, name: str, metadata: dict[str, Any]
) -> torch.Tensor | QuantizedWeight:
    """llama.cpp reads the shared expert's gate as a vector of hidden_size ({n_embd}); a file may
    store it so. The model holds it as a one-row matrix, as transformers does."""
    vector = isinstance(weights, torch.Tensor) and weights.dim() == 1
    return weights.reshape(1, -1) if vector and name.endswith("ffn_gate_inp_shexp.weight") else weights


# What llama.cpp's converter changed in the tensors of each architecture, undone.
_CONVERTER_CHANGES = {
    "llama": _undo_rotary_permutation,
    "gemma2": _undo_norm_offset,
    "gemma3": _undo_norm_offset,
    "qwen2moe": _shared_gate_as_a_row,
}
