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


class ShapeMismatchError(ModelLoadError):
    """A tensor of the weights has another shape than the config makes it."""


def check_state_shapes(model, state: dict) -> None:
    """ShapeMismatchError in one line, naming the first tensor and both shapes, unless every
    tensor of state has the shape model (built from the config, on the meta device) expects:
    a config whose head_dim or intermediate_size disagrees with the weights otherwise stopped
    start-up with torch's many-line load_state_dict error."""
    expected = model.state_dict()
    wrong = [name for name, tensor in state.items()
             if name in expected and tuple(tensor.shape) != tuple(expected[name].shape)]
    if wrong:
        name = wrong[0]
        more = f" ({len(wrong) - 1} more tensors disagree)" if len(wrong) > 1 else ""
        raise ShapeMismatchError(
            f"the weights do not match the model's config: {name} is {list(state[name].shape)} in the "
            f"weights, the config makes it {list(expected[name].shape)} (head_dim, intermediate_size, "
            f"vocab_size or the head counts?){more}")
