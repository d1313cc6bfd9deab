"""The Llama-family model, its config, and loading from Hugging Face folders or GGUF files.

The names below load on first use, not with the package: a process that only reads a tokenizer
(pagedllm.model.tokenizer_files, in the API process of `pagedllm serve`) never imports torch."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ModelConfig": "pagedllm.model.config",
    "CorruptCheckpointError": "pagedllm.model.errors",
    "MissingTensorError": "pagedllm.model.errors",
    "ModelFileNotFoundError": "pagedllm.model.errors",
    "ModelLoadError": "pagedllm.model.errors",
    "UnsupportedModelError": "pagedllm.model.errors",
    "LlamaForCausalLM": "pagedllm.model.llama",
    "LoadedModel": "pagedllm.model.loader",
    "load_model": "pagedllm.model.loader",
    "resolve_dtype": "pagedllm.model.loader",
    "load_tokenizer": "pagedllm.model.tokenizer_files",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
