"""The CPU kernels' build: bounded, in a child process, safe to stop, shared between checkouts."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pagedllm.kernels import compiled, tiers
from tests.model.tiny import make_hf_model, save_checkpoint

ROOT = Path(__file__).parents[2]
TIER = tiers.detect_tier()  # the one an engine builds by default
needs_compiler = pytest.mark.skipif(TIER == "portable" or compiled._why_unavailable(TIER) is not None,
                                    reason="the CPU kernels cannot be built here")


def _env(cache_dir: Path, **extra: str) -> dict:
    return {**os.environ, "PAGEDLLM_CACHE_DIR": str(cache_dir),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra}


def _kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL a process and everything under it, as a closed terminal would leave things."""
    tree = psutil.Process(process.pid)
    for p in [*tree.children(recursive=True), tree]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    process.wait()


@needs_compiler
@pytest.mark.timeout(600)  # its own bounds: 120 s for the build to start, 300 s for the start after
def test_a_start_after_a_build_killed_midway_still_serves(tmp_path):
    cache = tmp_path / "cache"
    # Children this process had before (another test's server, under pytest-xdist a worker's
    # session fixtures) are not this test's to judge.
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    builder = subprocess.Popen(
        [sys.executable, "-c", "from pagedllm.kernels import tiers; tiers.available()"],
        env=_env(cache), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(cache.glob("torch_extensions/*/build.ninja")):  # the compiler is running
        assert builder.poll() is None and time.monotonic() < deadline, "the build never started"
        time.sleep(0.2)
    _kill_tree(builder)
    assert list(cache.glob("torch_extensions/*/lock")), "torch's lock file is left behind"
    assert not list(cache.glob("torch_extensions/*/BUILT"))

    model = save_checkpoint(make_hf_model("llama_gqa_untied"), tmp_path / "model")
    # A bound shorter than a build: this start takes the portable path, with one warning.
    served = subprocess.run(
        [sys.executable, "-m", "pagedllm.cli", "generate", "ab", "--model", str(model),
         "--dtype", "float32", "--max-tokens", "4", "--temperature", "0"],
        env=_env(cache, PAGEDLLM_KERNEL_BUILD_TIMEOUT_S="3"), capture_output=True, text=True,
        timeout=300)
    assert served.returncode == 0, served.stderr[-2000:]
    assert served.stdout.strip(), "no text generated"
    warnings = [line for line in served.stderr.splitlines() if "CPU kernels unavailable" in line]
    assert len(warnings) == 1 and "did not finish within 3 s" in warnings[0], served.stderr[-2000:]
    assert not [p for p in psutil.Process().children(recursive=True) if p.pid not in before
                and p.is_running() and p.status() != psutil.STATUS_ZOMBIE], "a build was left running"


@needs_compiler
@pytest.mark.timeout(300)
def test_a_build_stops_when_the_process_that_started_it_is_killed(tmp_path):
    """Issue 32, finding 8: a SIGKILLed process left its kernel build compiling as an orphan (the
    build runs in a session of its own, which a kill of its starter alone does not reach)."""
    cache = tmp_path / "cache"
    builder = subprocess.Popen(
        [sys.executable, "-c", "from pagedllm.kernels import tiers; tiers.available()"],
        env=_env(cache), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(cache.glob("torch_extensions/*/build.ninja")):  # the compiler is running
        assert builder.poll() is None and time.monotonic() < deadline, "the build never started"
        time.sleep(0.2)
    build = psutil.Process(builder.pid).children(recursive=True)
    assert build, "no build child"
    builder.send_signal(signal.SIGKILL)  # the starter only, as the OOM killer would
    builder.wait()
    gone, alive = psutil.wait_procs(build, timeout=20)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], f"left running: {alive}"


@pytest.mark.parametrize("tier", ["avx2", "avx512", "amx"])
def test_two_checkouts_share_one_build(tier, tmp_path, monkeypatch):
    """The build folder is named by the tier and the sources' bytes, not where they are."""
    here = compiled._build_name(tier)
    copy = tmp_path / "elsewhere" / "csrc"
    shutil.copytree(compiled._CSRC, copy)
    monkeypatch.setattr(compiled, "_CSRC", copy)
    assert compiled._build_name(tier) == here
    assert here.startswith(compiled.namespace(tier))
    (copy / "vec.h").write_text((copy / "vec.h").read_text() + "\n// changed\n")
    assert compiled._build_name(tier) != here


def test_a_bad_timeout_is_named(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_KERNEL_BUILD_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="PAGEDLLM_KERNEL_BUILD_TIMEOUT_S"):
        compiled.build_timeout_s()
