"""A model's tokenizer alone, from its Hugging Face folder or GGUF file, without torch: the API
process of `pagedllm serve` needs only this (the engine core process loads the weights), and
stays small and quick to start without torch."""

from __future__ import annotations

from pathlib import Path

import gguf

from pagedllm.model.errors import CorruptCheckpointError, ModelFileNotFoundError
from pagedllm.text.tokenizer import Tokenizer


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Only the tokenizer of the model at path (None: the default model); no weights read."""
    if path is None:
        from pagedllm.model.default_model import default_model_path

        path = default_model_path()
    path = Path(path).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return Tokenizer.from_hf_folder(path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        path = ggufs[0] if len(ggufs) == 1 else path
    if path.suffix == ".gguf" and path.is_file():
        try:
            reader = gguf.GGUFReader(path)
        except Exception as exc:  # the reader fails in many ways on a damaged file
            raise CorruptCheckpointError(f"{path}: cannot read the GGUF file ({type(exc).__name__}: "
                                         f"{exc}); it is truncated or damaged") from None
        return Tokenizer.from_gguf(reader)
    raise ModelFileNotFoundError(
        f"{path}: no tokenizer.json or .gguf file to read a tokenizer from")
