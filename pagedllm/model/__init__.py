"""The Llama-family model, its config, and loading from Hugging Face folders or GGUF files."""

from pagedllm.model.config import ModelConfig
from pagedllm.model.errors import (
    CorruptCheckpointError,
    MissingTensorError,
    ModelFileNotFoundError,
    ModelLoadError,
    UnsupportedModelError,
)
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.loader import LoadedModel, load_model, load_tokenizer, resolve_dtype

__all__ = [
    "CorruptCheckpointError",
    "LlamaForCausalLM",
    "LoadedModel",
    "MissingTensorError",
    "ModelConfig",
    "ModelFileNotFoundError",
    "ModelLoadError",
    "UnsupportedModelError",
    "load_model",
    "load_tokenizer",
    "resolve_dtype",
]
