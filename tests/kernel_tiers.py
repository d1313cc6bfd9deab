"""The kernel tiers this CPU runs (pagedllm.kernels.tiers), for tests parametrized over them: a test
asks for the `tier` fixture (its folder's conftest imports it) (every compiled tier the CPU runs,
e.g. avx512 and avx2 on an AVX-512 machine) and runs with that tier chosen, the choice before it
restored after."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from pagedllm.kernels import compiled, tiers

COMPILED_TIERS = [t for t in tiers.runnable_tiers() if t != "portable" and compiled._sources(t)]
# Those that compile the attention kernels (paged attention, the KV writes).
ATTENTION_TIERS = [t for t in COMPILED_TIERS if "attention" in compiled.families(t)]


@contextmanager
def kernel_tier(tier: str):
    """The kernels of `tier` chosen for the layers built (and the wrappers called) inside."""
    saved = list(tiers._choice)
    try:
        yield tiers.select(tier)
    finally:
        tiers._choice[:] = saved


def _chosen(name: str):
    with kernel_tier(name) as choice:
        if not choice.compiled:
            pytest.fail(f"the {name} tier's kernels did not build: {choice.why_portable}")
        yield name


@pytest.fixture(params=COMPILED_TIERS)
def tier(request):
    yield from _chosen(request.param)


@pytest.fixture(params=ATTENTION_TIERS)
def attention_tier(request):
    """Every tier this CPU runs whose attention kernels are compiled, chosen in turn."""
    yield from _chosen(request.param)
