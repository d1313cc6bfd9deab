"""Load a model and its tokenizer from a Hugging Face folder or a GGUF file.

Weights are read without pickle: safetensors through memory maps, GGUF through gguf's reader.
`quantization` decides what stays quantized: "auto" keeps a GGUF's quantized matrices quantized
(repacked for the kernels; types without a repacker are dequantized) and leaves float checkpoints
float; "none" dequantizes everything at load; "int8" / "int4" quantize a Hugging Face folder's
matmul weights group-wise at load. Every failure a user can cause (a wrong path, a missing or
truncated file, an architecture or quantization we do not run) raises a ModelLoadError, a
ValueError, whose message names the file and the problem.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open

from pagedllm.config import QUANTIZATION_CHOICES, canonical_dtype
from pagedllm.kernels import tiers
from pagedllm.model.config import ModelConfig, parse_dtype_name
from pagedllm.model.errors import (
    CorruptCheckpointError,
    MissingTensorError,
    ModelFileNotFoundError,
    ModelLoadError,
    UnsupportedModelError,
)
from pagedllm.model.gguf_file import GGUFCheckpoint
from pagedllm.model.gpt_oss import UnstackedExperts
from pagedllm.model.granite_hybrid import GraniteHybridForCausalLM
from pagedllm.model.hybrid import HybridForCausalLM
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.quant_weight import QUANTIZATION_BITS, QuantizedWeight, check_quantizable, quantize
from pagedllm.text.tokenizer import Tokenizer
from pagedllm.utils import cpu_has_native_bf16

if TYPE_CHECKING:
    from pagedllm.distributed.shard import RankShard

logger = logging.getLogger(__name__)



DEFAULT_GROUP_SIZE = 32


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path
    weights_note: str = ""  # what was kept quantized and what is float, for the start-up line


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """"auto" is bfloat16 where the device does bfloat16 math natively; else float32 on a CPU and
    float16 on a GPU."""
    if canonical_dtype(dtype) == "auto":  # ValueError naming the valid ones
        if torch.device(device).type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return parse_dtype_name(canonical_dtype(dtype))


def resolve_model_dtype(dtype: str | torch.dtype, device: str | torch.device, model: str | Path | None,
                        quantization: str = "auto") -> torch.dtype:
    """resolve_dtype for a model (a path; None: the default model). "auto" is also bfloat16 on a
    CPU without bf16 math where the model's matrices stay quantized and the chosen kernels multiply
    them with int8 activations (the avx2 tier, avx512 with VNNI: KernelChoice.int8_activations), as
    llama.cpp does: the large matmuls then run on integer dot products whatever the activations'
    dtype, many rows multiply in fp32 (QuantLinear._dequantized_tiles), and bf16 halves the
    activations and the KV cache. float32 took its exact kernel there instead: the default GGUF
    decoded 2.5x slower (AVX2 EPYC, docs/benchmarks.md). Likewise at the portable tier, where only
    bf16 takes torch's int4 kernel (torch_int4_linear.py) and float32 dequantizes tiles per call."""
    resolved = resolve_dtype(dtype, device)
    choice = tiers.current()
    if (canonical_dtype(dtype) != "auto" or resolved != torch.float32 or torch.device(device).type != "cpu"
            or not (choice.int8_activations or not choice.has("quantized matmul"))):
        return resolved
    return torch.bfloat16 if _matrices_stay_quantized(model, quantization) else resolved


def _matrices_stay_quantized(model: str | Path | None, quantization: str) -> bool:
    """Whether loading model with this quantization keeps its matrices quantized: int8/int4 asked
    for, or a GGUF with quantized tensors under auto. False where the file cannot be read (the
    loader then says why)."""
    if quantization in QUANTIZATION_BITS:
        return True
    if quantization != "auto":
        return False
    try:
        path = _model_path(model)
        if path.suffix != ".gguf" or not path.is_file():
            return False
        return GGUFCheckpoint.holds_quantized_tensors(path)
    except Exception:  # noqa: BLE001 - any unreadable file: load_model reports it
        return False


def load_model(path: str | Path | None = None, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu", quantization: str = "auto",
               group_size: int = DEFAULT_GROUP_SIZE, shard: RankShard | None = None) -> LoadedModel:
    """The model at path (a Hugging Face folder or a .gguf file; None: the default model), its
    weights on `device` (streamed there one tensor at a time). shard: only a tensor-parallel
    rank's share of it (pagedllm.distributed); LoadedModel.config is still the whole model's."""
    path = _model_path(path)
    torch_dtype = resolve_model_dtype(dtype, device, path, quantization)
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"unknown quantization {quantization!r}; use {', '.join(QUANTIZATION_CHOICES)}")
    started = time.perf_counter()
    if not path.exists():
        raise ModelFileNotFoundError(f"{path}: no such model file or folder")
    weights = _WeightPolicy(quantization, group_size, torch_dtype, torch.device(device))
    if path.is_dir():
        loaded = _load_hf_folder(path, torch_dtype, device, weights, shard)
    elif path.suffix == ".gguf":
        loaded = _load_gguf(path, torch_dtype, device, weights, shard)
    else:
        raise ModelLoadError(
            f"{path}: expected a .gguf file or a Hugging Face model folder (with config.json)")
    loaded.model.to(device)  # the buffers made on the CPU (rotary frequencies); weights are there
    loaded.weights_note = weights.note()
    logger.info("loaded %s (%s, %s) in %.2f s; weights: %s", path, loaded.config.architecture,
                torch_dtype, time.perf_counter() - started, loaded.weights_note)
    return loaded


class _WeightPolicy:
    """Which weights stay or become quantized, and a tally of what each became."""

    # Hugging Face names of the matmul weights (the rest, norms and biases, stay float).
    # Mixtral's experts are w1 (gate), w2 (down) and w3 (up); its router (gate.weight) stays float.
    _MATMUL_SUFFIXES = ("_proj.weight", "lm_head.weight", "embed_tokens.weight", ".w1.weight", ".w2.weight",
                        ".w3.weight")

    _ROUTERS = (".gate.weight", ".shared_expert_gate.weight")

    def __init__(self, quantization: str, group_size: int, dtype: torch.dtype, device: torch.device):
        self.quantization = quantization
        self.group_size = group_size
        self.dtype = dtype
        self.tally: dict[str, int] = {}
        self.device = device
        self.on_cpu = device.type == "cpu"
        # Where a kernel computes on quantized weights: the CPU's compiled ones, and on CUDA the
        # Triton one (kernels/triton_quant_matmul.py). Elsewhere a GGUF's weights are dequantized.
        self.keeps_quantized = self.on_cpu or (device.type == "cuda" and
                                               importlib.util.find_spec("triton") is not None)
        if quantization in QUANTIZATION_BITS and not self.on_cpu:
            raise ValueError(f"quantization={quantization} runs on the CPU; {device} takes auto or none")

    @property
    def keeps_mxfp4(self) -> bool:
        """Whether a Hugging Face folder's MXFP4 experts (gpt-oss) stay MXFP4: as a GGUF's
        quantized tensors do (int8 / int4 leave them as they are: already 4-bit)."""
        return self.quantization != "none" and self.keeps_quantized

    def gguf_getter(self, checkpoint: GGUFCheckpoint, path: Path):
        if self.quantization in QUANTIZATION_BITS:
            raise ValueError(
                f"{path}: quantization={self.quantization} quantizes a Hugging Face folder's float "
                "weights; a GGUF file keeps its own quantization (auto) or is dequantized (none)")
        keep = self.quantization == "auto" and self.keeps_quantized

        def get(hf: str):
            # A router's weight (and Qwen2-MoE's shared-expert gate) stays float whatever the file
            # holds: model/moe.py's Router multiplies in float32, as transformers does.
            weight = checkpoint.get_hf_tensor(hf, keep_quantized=keep and not hf.endswith(self._ROUTERS))
            if isinstance(weight, QuantizedWeight) and not self.on_cpu:
                weight = weight.to(self.device)
            type_name = checkpoint.tensors[checkpoint.hf_names[hf]].tensor_type.name
            self._count(weight, type_name)
            return weight
        return get

    def safetensors_getter(self, weights: SafetensorsWeights):
        bits = QUANTIZATION_BITS.get(self.quantization)

        def get(name: str):
            tensor = weights.get(name)
            if isinstance(tensor, QuantizedWeight):  # gpt-oss's MXFP4 experts, kept as they are
                self._count(tensor, tensor.source)
                return tensor if self.on_cpu else tensor.to(self.device)
            if bits is None or tensor.dim() != 2 or not name.endswith(self._MATMUL_SUFFIXES):
                self._count(tensor, str(tensor.dtype).removeprefix("torch."))
                return tensor
            # The embedding and LM head take 8 bits even at int4, as llama.cpp's Q4 files keep them.
            head_bits = 8 if name.endswith(("lm_head.weight", "embed_tokens.weight")) else bits
            why = check_quantizable(tuple(tensor.shape), head_bits, self.group_size)
            if why:
                self._count(tensor, f"{str(tensor.dtype).removeprefix('torch.')} ({why})")
                return tensor
            weight = quantize(tensor, head_bits, self.group_size)
            self._count(weight, f"float -> {weight.source} g{self.group_size}")
            return weight
        return get

    def _count(self, weight, source: str) -> None:
        kept = "quantized" if isinstance(weight, QuantizedWeight) else \
            f"as {str(self.dtype).removeprefix('torch.')}"
        key = f"{source} {kept}"
        self.tally[key] = self.tally.get(key, 0) + 1

    def note(self) -> str:
        return ", ".join(f"{count} x {key}" for key, count in self.tally.items())


# The hybrid families' model classes (recurrent layers beside attention); every other family is
# a LlamaForCausalLM.
_HYBRID_CLASSES = {"Qwen3_5ForCausalLM": HybridForCausalLM,
                   "GraniteMoeHybridForCausalLM": GraniteHybridForCausalLM}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The class that builds a model of config's family."""
    return _HYBRID_CLASSES.get(config.architecture, LlamaForCausalLM)


def recurrent_state_shapes(config: ModelConfig) -> list[tuple[int, ...]]:
    """The tensors of one request's recurrent state ([] for a model without recurrent layers),
    from its config alone: what its model class's state_shapes will be."""
    return model_class(config).request_state_shapes(config) if config.is_hybrid else []


def _model_path(path: str | Path | None) -> Path:
    """The path asked for, or the default model's."""
    if path is None:
        from pagedllm.model.default_model import default_model_path

        path = default_model_path()
    return Path(path).expanduser()


def read_model_config(path: str | Path | None = None) -> ModelConfig:
    """Only the shape of the model at path (None: the default model); no weights read."""
    path = _model_path(path)
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        path = ggufs[0] if len(ggufs) == 1 else path
    if path.is_file() and path.suffix == ".gguf":
        return GGUFCheckpoint(path).model_config()
    if path.is_dir() and (path / "config.json").is_file():
        return ModelConfig.from_hf_config(_read_json(path / "config.json"))
    raise ModelFileNotFoundError(f"{path}: expected a .gguf file or a Hugging Face model folder "
                                 "(with config.json)")


def _load_gguf(path: Path, dtype: torch.dtype, device: str | torch.device,
               weights: _WeightPolicy, shard: RankShard | None) -> LoadedModel:
    checkpoint = GGUFCheckpoint(path)
    config = checkpoint.model_config()
    checkpoint.check_types()
    tokenizer = Tokenizer.from_gguf(checkpoint.metadata)
    get = weights.gguf_getter(checkpoint, path)
    with _naming(path):
        model = model_class(config).from_hf_tensors(config, set(checkpoint.hf_names), get, dtype, device,
                                                    shard)
    factors = checkpoint.rope_freq_factors()
    if factors is not None:
        model.rotary.inv_freq /= factors
    checkpoint.check_all_read()
    return LoadedModel(model, dataclasses.replace(config, dtype=dtype), tokenizer, path)


def _load_hf_folder(folder: Path, dtype: torch.dtype, device: str | torch.device,
                    weights: _WeightPolicy, shard: RankShard | None) -> LoadedModel:
    config_file = folder / "config.json"
    if not config_file.is_file():
        ggufs = sorted(folder.glob("*.gguf"))
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0], dtype, device, weights, shard)
        raise ModelFileNotFoundError(f"{config_file}: no config.json in the model folder")
    config = ModelConfig.from_hf_config(
        _read_json(config_file), _read_json(folder / "generation_config.json", required=False))
    if not (folder / "tokenizer.json").is_file():
        raise ModelFileNotFoundError(f"{folder / 'tokenizer.json'}: no tokenizer in the folder")
    tokenizer = Tokenizer.from_hf_folder(folder)
    with SafetensorsWeights(folder) as tensors, _naming(folder):
        if config.architecture == "GptOssForCausalLM":  # its experts stacked (float or MXFP4)
            tensors = UnstackedExperts(tensors.names, tensors.get, config.num_experts,
                                       dequantize=not weights.keeps_mxfp4)
        model = model_class(config).from_hf_tensors(
            config, tensors.names, weights.safetensors_getter(tensors), dtype, device, shard)
    return LoadedModel(model, dataclasses.replace(config, dtype=dtype), tokenizer, folder)


@contextmanager
def _naming(path: Path):
    """Prefix the path to errors raised where it is not known."""
    try:
        yield
    except MissingTensorError as exc:
        raise MissingTensorError(f"{path}: {exc}") from None


class SafetensorsWeights:
    """The tensors of one or several (sharded) .safetensors files, by name, memory-mapped."""

    def __init__(self, folder: Path):
        self._files = {file: None for file in _weight_files(folder)}
        self._name_to_file: dict[str, Path] = {}

    def __enter__(self) -> SafetensorsWeights:
        for file in self._files:
            handle = _open_safetensors(file)
            self._files[file] = handle
            self._name_to_file.update(dict.fromkeys(handle.keys(), file))
        return self

    def __exit__(self, *exc) -> None:
        self._files = dict.fromkeys(self._files)

    @property
    def names(self) -> set[str]:
        return set(self._name_to_file)

    def get(self, name: str) -> torch.Tensor:
        file = self._name_to_file[name]
        try:
            return self._files[file].get_tensor(name)
        except SafetensorError as exc:
            raise CorruptCheckpointError(f"{file}: cannot read tensor {name} ({exc})") from None


def _weight_files(folder: Path) -> list[Path]:
    index_file = folder / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = _read_json(index_file).get("weight_map", {})
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelFileNotFoundError(
                f"{index_file}: lists weight files that are not there: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
            raise UnsupportedModelError(
                f"{folder}: only pickled weights (.bin/.pt), which we never load; "
                "convert them to safetensors")
        raise ModelFileNotFoundError(f"{folder}: no *.safetensors weight files in the folder")
    return files


def _open_safetensors(file: Path):
    try:
        handle = safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise CorruptCheckpointError(
            f"{file}: cannot read the safetensors file ({exc}); is it truncated?") from None
    return handle


def _read_json(path: Path, required: bool = True) -> dict:
    if not path.is_file():
        if required:
            raise ModelFileNotFoundError(f"{path}: file not found")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
