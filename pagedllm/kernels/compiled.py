"""Building and loading pagedllm's compiled CPU kernels (csrc/): paged attention
(paged_attention.cpp), the elementwise fusions around it in a layer (fused_ops.cpp: RMSNorm with
the residual add, rotary in place, SiLU-and-mul), matmuls over quantized weights (quant_matmul.cpp,
quant_amx.cpp) and over bf16 weights packed for AMX tiles (dense_amx.cpp); and random sampling of
rows with a temperature alone (sample.cpp). Their Python faces live by family: attention/cpu.py,
linear.py, elementwise.py, sampling.py. Built (or found) when an engine starts on the CPU, with the
local C++ compiler, cached per machine kind, and skipped (with one log line) where they cannot be:
callers then take the portable torch path.

The build goes to $PAGEDLLM_CACHE_DIR, else ~/.cache/pagedllm, in a folder named by the source,
torch, Python and the CPU features compiled for, so a rebuild only happens when one of them changes,
and every checkout with the same sources shares one build. It runs in a child process, so it is
bounded: one that has not finished within $PAGEDLLM_KERNEL_BUILD_TIMEOUT_S (default 900) is
stopped and the engine takes the portable path, with one warning. A process stopped mid-build
(Ctrl-C, a closed terminal) leaves no lock that blocks the next one (_build_lock), and a library
counts as built only once its build finished (the BUILT marker), so the next start builds again.
PAGEDLLM_ATTENTION=torch turns the kernels off (the portable torch path runs instead).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from pagedllm import envs
from pagedllm.utils import cpu_flags

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("paged_attention.cpp", "fused_ops.cpp", "quant_matmul.cpp", "quant_amx.cpp", "dense_amx.cpp",
            "sample.cpp")
_HEADERS = ("vec.h", "quant_packed.h", "amx.h")
_REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma")
# -fopenmp: ATen's parallel_for is inline OpenMP in its header; without it every call runs on one
# thread. (The extension then shares torch's libgomp: same soname, already loaded.)
_CFLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
# Compiled in where the CPU has them: bf16 dot products (attention scores, quantized matmuls), AMX
# tiles (bf16 matmuls, quantized matmuls over many rows, attention over prefill chunks).
_OPTIONAL_CFLAGS = {"avx512_bf16": "-mavx512bf16", "amx_tile": "-mamx-tile", "amx_bf16": "-mamx-bf16"}
# The activation dtypes the kernels are compiled for.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool once a load was tried; "why": the reason it failed


def _cflags() -> list[str]:
    flags = cpu_flags()
    return _CFLAGS + [opt for flag, opt in _OPTIONAL_CFLAGS.items() if flag in flags]


def cache_dir() -> Path:
    return envs.PAGEDLLM_CACHE_DIR / "torch_extensions"


def _build_name() -> str:
    key = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        key.update((_CSRC / name).read_bytes())
    key.update(" ".join(_cflags()).encode())
    key.update(f"{torch.__version__} {sys.version_info[:2]} {platform.machine()}".encode())
    return f"pagedllm_cpu_{key.hexdigest()[:16]}"


def _why_unavailable() -> str | None:
    if envs.PAGEDLLM_ATTENTION == "torch":
        return "PAGEDLLM_ATTENTION=torch"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the kernel is written for x86-64 with AVX-512; this is {platform.machine()}"
    missing = [f for f in _REQUIRED_CPU_FLAGS if f not in cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    missing = [name for name in _SOURCES + _HEADERS if not (_CSRC / name).is_file()]
    if missing:
        return f"{', '.join(missing)} missing from {_CSRC}"
    if shutil.which(envs.CXX) is None:
        return "no C++ compiler (c++ or $CXX) on PATH"
    return None


def available() -> bool:
    """Whether the kernel is loaded (building it on the first call where it can be; an engine
    calls this at start-up)."""
    if "ok" in _state:
        return bool(_state["ok"])
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
    return bool(_state["ok"])


def unavailable_reason() -> str | None:
    """Why the kernels did not load (None where they did, or were not tried yet)."""
    return _state.get("why")


_BUILT = "BUILT"  # written into the build folder once the library there is whole


def _load() -> bool:
    why = _why_unavailable()
    if why is None:
        try:
            name = _build_name()
            build_dir = cache_dir() / name
            if not (build_dir / _BUILT).is_file():
                why = _build_in_child(build_dir, name)
            if why is None:
                torch.ops.load_library(str(build_dir / f"{name}.so"))
                logger.debug("CPU kernels loaded from %s", build_dir)
                return True
        except Exception as exc:  # a failed build must never stop the engine
            why = f"the build failed ({type(exc).__name__}: {str(exc).strip()[-500:]})"
    _state["why"] = why
    logger.warning("CPU kernels unavailable, using the portable torch path: %s", why)
    return False


def build_timeout_s() -> float:
    return envs.PAGEDLLM_KERNEL_BUILD_TIMEOUT_S


def _build_in_child(build_dir: Path, name: str) -> str | None:
    """Build the library in a child process (its own process group, so a stop takes the compiler
    with it), waiting at most build_timeout_s(). None once built; else why not."""
    timeout = build_timeout_s()
    spec = {"name": name, "build_dir": str(build_dir), "cflags": _cflags(),
            "files": {n: str(_CSRC / n) for n in _SOURCES + _HEADERS}, "sources": list(_SOURCES)}
    logger.info("building pagedllm's CPU kernels in %s: once per version of their sources, about "
                "1-2 minutes (at most %.0f s, PAGEDLLM_KERNEL_BUILD_TIMEOUT_S)", build_dir, timeout)
    started = time.monotonic()
    env = envs.child_environ()
    child = subprocess.Popen(
        [sys.executable, "-c", "import json, sys; from pagedllm.kernels import compiled; "
                               "compiled.build(json.loads(sys.argv[1]))", json.dumps(spec)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        output, _ = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(child)
        return f"the build did not finish within {timeout:.0f} s (PAGEDLLM_KERNEL_BUILD_TIMEOUT_S)"
    except BaseException:
        _stop(child)
        raise
    if child.returncode != 0:
        text = output.decode(errors="replace").strip()
        return f"the build failed (exit status {child.returncode}: {text[-500:]})"
    logger.info("CPU kernels built in %.0f s", time.monotonic() - started)
    return None


def _stop(child: subprocess.Popen) -> None:
    """Kill a build child and the compilers under it."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()


def build(spec: dict) -> None:
    """The build itself (run in the child _build_in_child starts): under the build folder's lock,
    unless another process finished it meanwhile; BUILT written last."""
    from torch.utils import cpp_extension

    build_dir = Path(spec["build_dir"])
    build_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(build_dir):
        if (build_dir / _BUILT).is_file():
            return
        # A build stopped while linking may have left a partial library that looks up to date.
        (build_dir / f"{spec['name']}.so").unlink(missing_ok=True)
        sources = _copy_sources(build_dir / "src", {n: Path(f) for n, f in spec["files"].items()})
        cpp_extension.load(name=spec["name"], sources=[sources[n] for n in spec["sources"]],
                           extra_cflags=spec["cflags"], extra_ldflags=["-fopenmp"],
                           build_directory=str(build_dir), is_python_module=False, verbose=False)
        (build_dir / _BUILT).write_text("")


def _copy_sources(src_dir: Path, files: dict[str, Path]) -> dict[str, str]:
    """The sources copied into the build folder, which is named by their hash: the build then
    names only paths inside it, so every checkout with the same sources shares one build instead
    of rebuilding it in turn. Their paths there, by name."""
    src_dir.mkdir(exist_ok=True)
    for name, path in files.items():
        target = src_dir / name
        text = path.read_bytes()
        if not target.is_file() or target.read_bytes() != text:
            target.write_bytes(text)
    return {name: str(src_dir / name) for name in files}


@contextmanager
def _build_lock(build_dir: Path):
    """One build at a time per folder, under a lock the OS drops when its holder dies.

    torch's own lock is a plain file that a process stopped mid-build (Ctrl-C during the first
    answer) leaves behind, and every later load would wait on it forever. Holding ours, no other
    pagedllm process is building here, so a torch lock file found now is stale: remove it."""
    with open(build_dir / "pagedllm.lock", "w") as handle:
        waited = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waited:
                    logger.info("waiting for another process that is building the CPU kernels in %s",
                                build_dir)
                    waited = True
                time.sleep(0.2)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
