"""Reading a llama.cpp GGUF file: metadata, and tensors dequantized under Hugging Face names."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from pagedllm.model.config import ModelConfig
from pagedllm.model.errors import CorruptCheckpointError, UnsupportedModelError

Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K})

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
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


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
        self.tensors = {t.name: t for t in self.reader.tensors}
        # Hugging Face name -> GGUF name, for the tensors we know.
        self.hf_names = {hf: name for name in self.tensors if (hf := hf_name(name)) is not None}

    def _check_complete(self) -> None:
        file_size = self.path.stat().st_size
        for tensor in self.reader.tensors:
            end = tensor.data_offset + tensor.n_bytes
            if end > file_size or tensor.data.nbytes < tensor.n_bytes:
                raise CorruptCheckpointError(
                    f"{self.path}: truncated: tensor {tensor.name} ends at byte {end} "
                    f"but the file has {file_size} bytes")

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_gguf_metadata(self.metadata, set(self.tensors))

    def check_types(self) -> None:
        """Refuse unsupported quantizations before spending time on the others."""
        for tensor in self.tensors.values():
            if tensor.tensor_type not in SUPPORTED_TYPES:
                raise UnsupportedModelError(
                    f"{self.path}: tensor {tensor.name} uses quantization type "
                    f"{tensor.tensor_type.name}, which is not supported; supported: "
                    f"{', '.join(sorted(t.name for t in SUPPORTED_TYPES))}")

    def get_hf_tensor(self, hf: str) -> torch.Tensor:
        """The tensor stored for Hugging Face name hf, dequantized to float32 and in the
        row order transformers uses."""
        name = self.hf_names[hf]
        weights = self.get_raw(name)
        if self.metadata["general.architecture"] == "llama":
            weights = _undo_rotary_permutation(weights, name, self.metadata)
        return weights

    def rope_freq_factors(self) -> torch.Tensor | None:
        """Llama 3.1 files carry their rope scaling as per-frequency divisors, not metadata."""
        return self.get_raw("rope_freqs.weight") if "rope_freqs.weight" in self.tensors else None

    def get_raw(self, name: str) -> torch.Tensor:
        tensor = self.tensors[name]
        data = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        if not data.flags.writeable:  # float32 tensors come back as views of the memory map
            data = data.copy()
        return torch.from_numpy(np.ascontiguousarray(data))


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _LAYER_NAMES:
        return None
    return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"


def _undo_rotary_permutation(
    weights: torch.Tensor, name: str, metadata: dict[str, Any]
) -> torch.Tensor:
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
    paired = weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:])
    return paired.transpose(1, 2).reshape(weights.shape).contiguous()
