"""Errors from reading a checkpoint. All are ValueErrors: a bad model path is bad user input."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """The checkpoint cannot be loaded; the message names the file and the problem."""


class ModelFileNotFoundError(ModelLoadError, FileNotFoundError):
    """A file the checkpoint needs (config, weights, tokenizer) is not there."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint describes a model (architecture, rope type, quantization) we cannot run."""


class CorruptCheckpointError(ModelLoadError):
    """A weights file is truncated or its header is unreadable."""


class MissingTensorError(ModelLoadError):
    """The weights lack tensors the model needs."""
