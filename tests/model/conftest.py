"""Fixtures for model tests: tiny checkpoints made once per session, and one thread."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.kernel_tiers import tier  # noqa: F401  (the compiled kernel tiers this CPU runs)


@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread():
    # These tests run small matmuls on a shared CI machine; when its cores are busy, OpenMP
    # threads that spin-wait for each other make them several times slower than one thread.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@dataclass
class TinyCheckpoint:
    shape: str
    folder: Path
    hf_model: torch.nn.Module


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(shape) -> TinyCheckpoint, saved as safetensors once per session."""
    pytest.importorskip("transformers")
    from tests.model.tiny import make_hf_model, save_checkpoint

    made: dict[str, TinyCheckpoint] = {}

    def get(shape: str) -> TinyCheckpoint:
        if shape not in made:
            hf_model = make_hf_model(shape)
            folder = save_checkpoint(hf_model, tmp_path_factory.mktemp(shape))
            made[shape] = TinyCheckpoint(shape, folder, hf_model)
        return made[shape]

    return get
