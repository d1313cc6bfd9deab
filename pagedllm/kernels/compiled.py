"""Building and loading pagedllm's compiled CPU kernels (csrc/): paged attention
(paged_attention.cpp and the files it names, a file per path), the elementwise fusions around it in
a layer (fused_ops.cpp: RMSNorm with the residual add, rotary in place, SiLU-and-mul), matmuls over
quantized weights (quant_matmul.cpp, quant_amx.cpp) and over bf16 weights packed for AMX tiles
(dense_amx.cpp); and random sampling of rows with a temperature alone (sample.cpp). Their Python
faces live by family: attention/cpu_attention.py, matmul.py, elementwise.py, sampling.py. Built (or
found) when an engine starts on the CPU, with the local C++ compiler, cached per machine kind, and
skipped (with one log line) where they cannot be: callers then take the portable torch path. One
extension per tier (tiers.py), each with its own -m flags and torch op namespace
(torch.ops.pagedllm_<tier>), so a machine runs and tests every tier it has side by side;
tiers.select loads the chosen one.

The build goes to $PAGEDLLM_CACHE_DIR, else ~/.cache/pagedllm, in a folder named by the tier, the
sources, torch, Python and the CPU features compiled for, so a rebuild only happens when one of
them changes, and every checkout with the same sources shares one build. It runs in a child process, so it is
bounded: one that has not finished within $PAGEDLLM_KERNEL_BUILD_TIMEOUT_S (default 900) is
stopped and the engine takes the portable path, with one warning. A process stopped mid-build
(Ctrl-C, a closed terminal) leaves no lock that blocks the next one (_build_lock), and a library
counts as built only once its build finished (the BUILT marker), so the next start builds again.
PAGEDLLM_ATTENTION=torch (or cpu_isa=portable) turns the kernels off (the portable torch path
runs instead).
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
_AVX512_SOURCES = ("attention_entry.cpp", "paged_attention.cpp", "write_kv.cpp", "attention_registration.cpp",
                   "fused_ops.cpp", "quant_matmul.cpp", "quant_int8_avx512.cpp", "quant_amx.cpp",
                   "dense_amx.cpp", "sample.cpp", "decode_layers.cpp", "lora.cpp", "moe_route.cpp",
                   "quant_embedding.cpp", "quant_argmax.cpp", "decode_burst.cpp")
_HEADERS = ("ops.h", "attention_plan.h", "vec.h", "quant_packed.h", "quant_int8_rows.h",
            "generic_quant_layout.h", "amx.h", "dispatch.h", "attention_common.h", "attention_kernel.h",
            "attention_amx_prefill.h", "attention_amx_decode.h", "vec_avx2.h")
# The AVX2 tier: plain C++ the compiler vectorizes for the tier's flags (norms/rotary, quantized
# matmuls), AVX2 intrinsics where that is not enough (int8 matmuls, attention), and the sources every
# tier shares (attention's entry points, the KV writes, a decode step's layers in one call).
_GENERIC_SOURCES = ("generic_fused_ops.cpp", "generic_quant.cpp", "quant_int8_avx2.cpp",
                    "attention_entry.cpp", "attention_avx2.cpp", "write_kv.cpp", "attention_registration.cpp",
                    "decode_layers.cpp", "lora.cpp", "moe_route.cpp", "quant_embedding.cpp",
                    "quant_argmax.cpp", "decode_burst.cpp")
# The avx2 tier's sources with no x86 intrinsics outside `#ifdef __AVX2__`: what an aarch64 build
# compiles as they are (attention_avx2.cpp has no ARM counterpart yet, so an aarch64 tier would
# have no attention kernel). tests/kernels/test_aarch64_sources.py builds each with Debian's cross
# compiler, which make install tries to install.
AARCH64_SOURCES = tuple(name for name in _GENERIC_SOURCES if name != "attention_avx2.cpp")
# The sources each tier builds (tiers.py says what a tier needs of the CPU), and the families
# they compile (the others run portable torch under that tier; the start-up line says which).
_TIER_SOURCES = {"amx": _AVX512_SOURCES, "avx512": _AVX512_SOURCES, "avx2": _GENERIC_SOURCES}
_ALL_FAMILIES = ("attention", "dense matmul", "quantized matmul", "norms/rotary", "sampling")
_TIER_FAMILIES = {"amx": _ALL_FAMILIES, "avx512": _ALL_FAMILIES,
                  "avx2": ("attention", "quantized matmul", "norms/rotary")}
# -fopenmp: ATen's parallel_for is inline OpenMP in its header; without it every call runs on one
# thread. (The extension then shares torch's libgomp: same soname, already loaded.)
_BASE_CFLAGS = ["-O3", "-fopenmp"]
_AVX512_CFLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
_TIER_CFLAGS = {"avx2": ["-mavx2", "-mfma", "-mf16c"], "avx512": _AVX512_CFLAGS,
                "amx": [*_AVX512_CFLAGS, "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]}
# Compiled in where the CPU has them: bf16 dot products (attention scores, quantized matmuls) and
# VNNI's int8 ones (quantized matmuls over bf16 activations) on AVX-512; AVX-VNNI's on AVX2. (The
# amx tier keeps its bf16 paths: no VNNI flag there.)
_TIER_OPTIONAL_CFLAGS = {"avx512": {"avx512_bf16": "-mavx512bf16", "avx512_vnni": "-mavx512vnni"},
                         "avx2": {"avx_vnni": "-mavxvnni"}}
# The activation dtypes the kernels are compiled for.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)

_lock = threading.Lock()
_loaded: dict[str, tuple[object | None, str | None]] = {}  # tier -> (its ops, or None and why not)


def namespace(tier: str) -> str:
    """The torch op namespace of a tier's extension (one per tier, so several load side by side)."""
    return f"pagedllm_{tier}"


def _sources(tier: str) -> tuple[str, ...]:
    return _TIER_SOURCES[tier]


def families(tier: str) -> tuple[str, ...]:
    """The kernel families a tier's extension compiles (dense matmul: AMX's where it runs)."""
    return _TIER_FAMILIES.get(tier, ())


def _cflags(tier: str) -> list[str]:
    flags = cpu_flags()
    optional = [opt for flag, opt in _TIER_OPTIONAL_CFLAGS.get(tier, {}).items() if flag in flags]
    return [*_BASE_CFLAGS, *_TIER_CFLAGS[tier], *optional, f"-DPAGEDLLM_NS={namespace(tier)}"]


def cache_dir() -> Path:
    return envs.PAGEDLLM_CACHE_DIR / "torch_extensions"


def _build_name(tier: str) -> str:
    key = hashlib.sha256()
    for name in _sources(tier) + _HEADERS:
        key.update((_CSRC / name).read_bytes())
    key.update(" ".join(_cflags(tier)).encode())
    key.update(f"{torch.__version__} {sys.version_info[:2]} {platform.machine()}".encode())
    return f"{namespace(tier)}_{key.hexdigest()[:16]}"


def _why_unavailable(tier: str) -> str | None:
    if not _sources(tier):
        return f"no compiled kernels are written for the {tier} tier"
    missing = [name for name in _sources(tier) + _HEADERS if not (_CSRC / name).is_file()]
    if missing:
        return f"{', '.join(missing)} missing from {_CSRC}"
    if shutil.which(envs.CXX) is None:
        return "no C++ compiler (c++ or $CXX) on PATH"
    return None


def load(tier: str) -> tuple[object | None, str | None]:
    """A tier's compiled ops (torch.ops.pagedllm_<tier>), built or found on the first call; or
    (None, why not). The caller (tiers.select) has checked that the CPU runs the tier."""
    with _lock:
        if tier not in _loaded:
            _loaded[tier] = _load(tier)
    return _loaded[tier]


_BUILT = "BUILT"  # written into the build folder once the library there is whole


def _load(tier: str) -> tuple[object | None, str | None]:
    why = _why_unavailable(tier)
    if why is None:
        try:
            name = _build_name(tier)
            build_dir = cache_dir() / name
            if not (build_dir / _BUILT).is_file():
                why = _build_in_child(build_dir, name, tier)
            if why is None:
                torch.ops.load_library(str(build_dir / f"{name}.so"))
                logger.debug("CPU kernels (%s) loaded from %s", tier, build_dir)
                return getattr(torch.ops, namespace(tier)), None
        except Exception as exc:  # a failed build must never stop the engine
            why = f"the build failed ({type(exc).__name__}: {str(exc).strip()[-500:]})"
    logger.warning("CPU kernels unavailable (%s tier), using the portable torch path: %s",
                   tier, why)
    return None, why


def build_timeout_s() -> float:
    return envs.PAGEDLLM_KERNEL_BUILD_TIMEOUT_S


def _build_in_child(build_dir: Path, name: str, tier: str) -> str | None:
    """Build the library in a child process (its own session, so a stop takes every compiler with
    it), waiting at most build_timeout_s(). None once built; else why not. The child holds the
    read end of a pipe whose write end only this process holds: when this process dies, however
    (SIGKILL included), the child's watchdog kills its session, so no compiler runs on orphaned."""
    timeout = build_timeout_s()
    spec = {"name": name, "build_dir": str(build_dir), "cflags": _cflags(tier),
            "files": {n: str(_CSRC / n) for n in _sources(tier) + _HEADERS},
            "sources": list(_sources(tier))}
    logger.info("building pagedllm's CPU kernels (%s tier) in %s: once per version of their sources, about "
                "1-2 minutes (at most %.0f s, PAGEDLLM_KERNEL_BUILD_TIMEOUT_S)", tier, build_dir,
                timeout)
    started = time.monotonic()
    env = envs.child_environ()
    parent_alive, alive_writer = os.pipe()
    try:
        code = ("import json, sys; from pagedllm.kernels import compiled; "
                "compiled.die_with_parent(int(sys.argv[2])); compiled.build(json.loads(sys.argv[1]))")
        child = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(spec), str(parent_alive)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            pass_fds=(parent_alive,))
    finally:
        os.close(parent_alive)
    try:
        output, _ = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(child)
        return f"the build did not finish within {timeout:.0f} s (PAGEDLLM_KERNEL_BUILD_TIMEOUT_S)"
    except BaseException:
        _stop(child)
        raise
    finally:
        os.close(alive_writer)
    if child.returncode != 0:
        text = output.decode(errors="replace").strip()
        return f"the build failed (exit status {child.returncode}: {text[-500:]})"
    logger.info("CPU kernels built in %.0f s", time.monotonic() - started)
    return None


def _stop(child: subprocess.Popen) -> None:
    """Kill a build child and the compilers under it."""
    _kill_session(child.pid)  # the child leads its session (start_new_session)
    child.wait()


def _kill_session(session: int) -> None:
    """SIGKILL every process of a session. Not its process group alone: ninja runs each compile
    command in a group of its own, so killing the child's group left the compilers running."""
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:  # no /proc: the session leader's group, the most there is to reach
        pids = []
    for pid in pids:
        try:
            if pid != os.getpid() and os.getsid(pid) == session:
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(session, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def die_with_parent(parent_alive: int) -> None:
    """In a build child: kill this process's session (the compilers with it, then itself) when end
    of file comes on parent_alive, a pipe whose write end only the parent holds: when it dies."""
    def watch() -> None:
        while os.read(parent_alive, 4096):  # the parent never writes: only end of file comes
            pass
        _kill_session(os.getsid(0))
        os._exit(1)

    threading.Thread(target=watch, name="pagedllm-build-watchdog", daemon=True).start()


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
