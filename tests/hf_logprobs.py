"""The oracle of logprob tests: transformers' float32 forward pass over a prompt, as log_softmax."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch


def forward_logprobs(model_dir) -> Callable[[list[int]], torch.Tensor]:
    """A function from prompt token ids to log_softmax of transformers' logits, [positions, vocab]
    (the test skips where transformers is missing)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def run(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([token_ids])).logits[0].float(), dim=-1)

    return run
