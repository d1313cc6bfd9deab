"""Reading a llama.cpp GGUF file: metadata, and tensors under Hugging Face names (dequantized, or
repacked quantized by gguf_repack), with what llama.cpp's converter changed in them undone (the
q/k row order of Llama and Granite, Gemma's norm offset, DeepSeek's kv_b_proj split in two for
absorption, Granite's gate/up projections split and Mamba2's A stored as -exp(A_log)).

gpt-oss's files (general.architecture "gpt-oss"): its sinks are attn_sinks.weight, its router
ffn_gate_inp (weight and bias), its experts ffn_{gate,up,down}_exps stacked (weights, typically
MXFP4, and biases), the gate and up columns llama.cpp's converter split out of transformers'
interleaved gate_up_proj; they come out under the per-expert names gpt_oss.py gives a Hugging Face
folder's.

Every tensor of a file must be read by the model built from it (or read on its own: the rope
factors): a file with one that is not is refused, naming it, rather than run without it. A family
we run only from Hugging Face folders is refused up front, naming the first tensor we cannot map
(Qwen3.5 / Qwen3-Next: their Gated DeltaNet layers' ssm_* tensors are not mapped yet).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from functools import partial
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
    # DeepSeek's latent attention and shared experts. llama.cpp's converter writes kv_b_proj as
    # attn_k_b and attn_v_b (older files: attn_kv_b); see _join_kv_b.
    "deepseek2": {**_LAYER_NAMES, "attn_q_a": "self_attn.q_a_proj", "attn_q_b": "self_attn.q_b_proj",
                  "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                  "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
                  **{f"ffn_{p}_shexp": f"mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")}},
}
# Tensors transformers names without a .weight suffix: GGUF name part -> the name's end.
_BARE_NAMES = {"attn_sinks": "self_attn.sinks"}
_GRANITE_HYBRID_NAMES = {name: hf for name, hf in _LAYER_NAMES.items() if name not in ("ffn_gate", "ffn_up")}
# Granite 4's hybrids: Mamba2 layers under ssm_*, the shared MLP as shared experts (or as the
# dense MLP), the experts stacked; gate and up halves are joined back (_JOINS).
_ARCH_LAYER_NAMES["granitehybrid"] = {
    **_GRANITE_HYBRID_NAMES, "ssm_in": "mamba.in_proj", "ssm_out": "mamba.out_proj",
    "ssm_conv1d": "mamba.conv1d", "ssm_norm": "mamba.norm", "ffn_down_shexp": "shared_mlp.output_linear",
    "ffn_down": "shared_mlp.output_linear", "ffn_gate_inp": "block_sparse_moe.router.layer",
    "ffn_down_exps": "block_sparse_moe.output_linear"}
# Layer tensors whose Hugging Face name is not "<name>.weight/bias" (keyed by the GGUF name's tail).
_EXACT_LAYER_NAMES = {
    "deepseek2": {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"},
    "granitehybrid": {"ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ssm_dt.bias": "mamba.dt_bias"},
}
# Hugging Face tensors llama.cpp's converter splits in two, per architecture: (theirs, the GGUF
# halves, the dimension they are joined along). DeepSeek's kv_b_proj is _SPLIT_KV_B's.
_JOINS = {"granitehybrid": [
    ("shared_mlp.input_linear.weight", ("ffn_gate_shexp", "ffn_up_shexp"), 0),
    ("shared_mlp.input_linear.weight", ("ffn_gate", "ffn_up"), 0),  # a dense Granite
    ("block_sparse_moe.input_linear.weight", ("ffn_gate_exps", "ffn_up_exps"), 1),  # [E, I, H] each
]}
# Tensors read apart from the Hugging Face names (GGUFCheckpoint's rope factors).
_READ_APART = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})
_SPLIT_KV_B = re.compile(r"blk\.(\d+)\.attn_([kv])_b\.weight")
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(weight|bias))?")

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
    "deepseek2": ("mlp", "gate", _QWEN_EXPERTS),
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
        # Tensors rebuilt from the halves llama.cpp's converter splits them into: Hugging Face
        # name -> (the GGUF halves, how they join). DeepSeek's kv_b_proj where the file has no
        # attn_kv_b beside its halves; Granite's gate and up projections.
        self.joined: dict[str, tuple[tuple[str, ...], Callable]] = {}
        for name in self.tensors:
            match = _SPLIT_KV_B.fullmatch(name)
            hf = match and f"model.layers.{match[1]}.self_attn.kv_b_proj.weight"
            if match and match[2] == "k" and hf not in self.hf_names:
                self.joined[hf] = ((name, f"blk.{match[1]}.attn_v_b.weight"), _join_kv_b)
        for layer in range(int(self.metadata.get(f"{self.architecture}.block_count", 0))):
            for theirs, halves, dim in _JOINS.get(self.architecture, []):
                parts = tuple(f"blk.{layer}.{half}.weight" for half in halves)
                if all(part in self.tensors for part in parts):
                    self.joined[f"model.layers.{layer}.{theirs}"] = (parts, partial(_join_halves, dim=dim))
        for hf, (parts, _) in self.joined.items():
            self.hf_names[hf] = parts[0]
        self.read: set[str] = set()  # the tensors get_hf_tensor and get_raw have read

    def unmapped_tensors(self) -> list[str]:
        """The file's tensors, in its order, that nothing here reads."""
        joined = {part for parts, _ in self.joined.values() for part in parts}
        read = set(self.hf_names.values()) | joined
        return [name for name in self.tensors if name not in read and not self._needs_no_reading(name)]

    def _needs_no_reading(self, name: str) -> bool:
        """Whether the model need not read name: a tensor read on its own (_READ_APART), or a half
        of a kv_b_proj the file also holds whole (attn_kv_b, read)."""
        if name in _READ_APART:
            return True
        match = _SPLIT_KV_B.fullmatch(name)
        return bool(match) and f"blk.{match[1]}.attn_kv_b.weight" in self.tensors

    def check_all_read(self) -> None:
        """Once the model is built: refuse a file with a tensor it did not read (a name we map, such
        as attention sinks, on a model that has no place for it), rather than run without it."""
        unread = [name for name in self.tensors if name not in self.read and not self._needs_no_reading(name)]
        if unread:
            raise UnsupportedModelError(
                f"{self.path}: GGUF architecture {self.architecture!r}: no place in the model for tensor "
                f"{unread[0]} ({len(unread)} tensors unread)")

    def check_all_mapped(self) -> None:
        """Refuse a file with a tensor we would not read (its model would run without it)."""
        unmapped = self.unmapped_tensors()
        if unmapped:
            hint = _UNMAPPED_HINT.get(self.architecture)
            raise UnsupportedModelError(
                f"{self.path}: GGUF architecture {self.architecture!r}: cannot map tensor {unmapped[0]} "
                f"({len(unmapped)} tensors unmapped)" + (f"; {hint}" if hint else ""))

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
        if self.architecture in _UNMAPPED_HINT:
            self.check_all_mapped()
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
        if hf in self.joined:
            parts, join = self.joined[hf]
            return join(*(self.get_raw(name) for name in parts))
        self.read.add(self.hf_names[hf])
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
        self.read.add(name)
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
    tail = match and ".".join(filter(None, (match[2], match[3])))
    exact = match and _EXACT_LAYER_NAMES.get(architecture, {}).get(tail)
    if exact:
        return f"model.layers.{match[1]}.{exact}"
    if match is None or match[3] is None or match[2] not in layer_names:
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


def _join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """kv_b_proj [heads x (nope + v), kv_lora_rank] from llama.cpp's halves: k_b [heads, kv_lora_rank,
    nope] (each head's key rows, transposed for absorption) and v_b [heads, v, kv_lora_rank]."""
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1])


def _join_halves(*halves: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cat(halves, dim=dim)


def _undo_rotary_permutation(
    weights: torch.Tensor | QuantizedWeight, name: str, metadata: dict[str, Any]
) -> torch.Tensor | QuantizedWeight:
    """llama.cpp's converter reorders q/k rows per head from the two-halves rotary layout to
    interleaved pairs (row j of half h goes to 2j+h). Put them back in halves."""
    arch = metadata["general.architecture"]
    if ".attn_q." in name:
        heads = metadata[f"{arch}.attention.head_count"]
    elif ".attn_k." in name:
        heads = metadata.get(f"{arch}.attention.head_count_kv") or metadata[f"{arch}.attention.head_count"]
        heads = max(heads) if isinstance(heads, list) else heads  # per layer: 0 on recurrent ones
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


# GGUF architectures of families we run only from Hugging Face folders: refused, naming the first
# tensor we cannot map, with this hint.
_UNMAPPED_HINT = {
    "qwen35": "Qwen3.5 hybrids load from their Hugging Face folder",
    "qwen35moe": "Qwen3.5 hybrids load from their Hugging Face folder",
    "qwen3next": "Qwen3-Next hybrids load from their Hugging Face folder",
}

def _undo_granite_hybrid(
    weights: torch.Tensor | QuantizedWeight, name: str, metadata: dict[str, Any]
) -> torch.Tensor | QuantizedWeight:
    """llama.cpp's converter permutes Granite's q/k rows as Llama's, stores Mamba2's A as -exp(A_log)
    and A, D as [heads, 1], the conv weight without its middle dimension, the gated norm per group."""
    tail = name.split(".", 2)[2] if name.startswith("blk.") else name
    if tail == "ssm_a":
        return torch.log(-weights).reshape(-1)
    if tail in ("ssm_d", "ssm_norm.weight"):
        return weights.reshape(-1)
    if tail == "ssm_conv1d.weight":
        return weights.unsqueeze(1)
    return _undo_rotary_permutation(weights, name, metadata)


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
    "granitehybrid": _undo_granite_hybrid,
    "gemma2": _undo_norm_offset,
    "gemma3": _undo_norm_offset,
    "qwen2moe": _shared_gate_as_a_row,
}
