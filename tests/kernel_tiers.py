"""The kernel tiers this CPU runs (pagedllm.kernels.tiers), for tests parametrized over them: a test
asks for the `tier` fixture (its folder's conftest imports it) (every compiled tier the CPU runs,
e.g. avx512 and avx2 on an AVX-512 machine) and runs with that tier chosen, the choice before it
restored after."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from pagedllm.kernels import compiled, tiers

COMPILED_TIERS = [t for t in tiers.runnable_tiers() if t != "portable" and compiled._sources(t)]


@contextmanager
def kernel_tier(tier: str):
    """The kernels of `tier` chosen for the layers built (and the wrappers called) inside."""
    saved = list(tiers._choice)
    try:
        yield tiers.select(tier)
    finally:
        tiers._choice[:] = saved


@pytest.fixture(params=COMPILED_TIERS)
def tier(request):
    with kernel_tier(request.param) as choice:
        if not choice.compiled:
            pytest.fail(f"the {request.param} tier's kernels did not build: {choice.why_portable}")
        yield request.param
