"""The CPU kernels' portable sources compile for aarch64 (issue 31: running on ARM is for later,
compiling there is now): Debian's cross compiler builds each of them to an object, with torch's
headers and the flags an extension build gives them (C++20, OpenMP, no -m flags)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from torch.utils.cpp_extension import include_paths

from pagedllm.kernels import compiled

CROSS = shutil.which("aarch64-linux-gnu-g++")


@pytest.mark.skipif(CROSS is None, reason="no aarch64 cross compiler: make install installs Debian's "
                    "g++-aarch64-linux-gnu where apt-get runs as root")
@pytest.mark.parametrize("source", compiled.AARCH64_SOURCES)
def test_the_source_compiles_for_aarch64(source, tmp_path):
    command = [CROSS, "-std=c++20", "-O1", "-fPIC", "-fopenmp", "-DPAGEDLLM_NS=pagedllm_aarch64",
               *(f"-I{path}" for path in include_paths()), "-c", str(compiled._CSRC / source),
               "-o", str(tmp_path / "out.o")]
    built = subprocess.run(command, capture_output=True, text=True, timeout=170)
    assert built.returncode == 0, built.stderr[-3000:]
    assert (tmp_path / "out.o").stat().st_size > 0


def test_only_the_x86_attention_is_left_out():
    assert set(compiled._sources("avx2")) - set(compiled.AARCH64_SOURCES) == {"attention_avx2.cpp"}
