"""The environment variables pagedllm reads, each declared once here: its name, what it parses to,
its default and what it means. Nothing else in the package reads `os.environ` (the engine core's
test hooks aside, which are leaving production code).

What an engine is asked to do is EngineConfig's (flags, `LLM(...)` arguments); the environment
holds only what is the process's or the machine's: where built kernels are cached, switches for
diagnosing the compiled kernels, secrets that must not show in the process list, the compiler,
and the variables a launcher (torchrun) hands a tensor-parallel rank.

`envs.PAGEDLLM_CACHE_DIR` reads the variable as it is now and parses it; a value it cannot parse
raises ValueError naming the variable and what it takes, and an empty value counts as unset (but
for a secret, where an empty key is an error of its own). A part reads what it needs once, when it
starts (a kernel load, a server's start), not per call: the kernel switches (PAGEDLLM_ATTENTION,
PAGEDLLM_ATTENTION_AMX, PAGEDLLM_DENSE_AMX, PAGEDLLM_DECODE_LAYERS) are read once, when the kernel
tier is chosen (kernels/tiers.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnvVar:
    name: str
    parse: Callable[[str], object]  # the text of a set, non-empty value -> its value
    default: object  # the value while unset (or empty)
    meaning: str
    empty_is_unset: bool = True  # False for secrets: an empty key is refused, not ignored


def _switch(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("1 or 0 (true/false, yes/no, on/off)")


def _one_of(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(" or ".join(choices))
        return text
    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ValueError("a positive number of seconds")
    return value


def _count(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError("an integer") from None


VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("PAGEDLLM_CACHE_DIR", Path, Path.home() / ".cache" / "pagedllm",
           "where the compiled CPU kernels are built and kept (torch_extensions/ under it), one "
           "build per version of their sources"),
    EnvVar("PAGEDLLM_KERNEL_BUILD_TIMEOUT_S", _seconds, 900.0,
           "a kernel build not finished within this many seconds is stopped and the engine takes "
           "the portable torch path"),
    EnvVar("PAGEDLLM_ATTENTION", _one_of("auto", "torch"), "auto",
           "torch: no compiled CPU kernels and no Triton, the portable torch path everywhere "
           "(a reference to compare against)"),
    EnvVar("PAGEDLLM_ATTENTION_AMX", _switch, True,
           "0: bf16 prefill attention on AVX-512 alone, not AMX tiles (for measurements)"),
    EnvVar("PAGEDLLM_DENSE_AMX", _switch, True,
           "0: bf16 matmuls through oneDNN's packing, not pagedllm's AMX kernel (for measurements)"),
    EnvVar("PAGEDLLM_DECODE_LAYERS", _switch, True,
           "0: decode steps run the layers one Python call at a time, not all in one compiled call "
           "(model/decode_layers.py; for measurements)"),
    EnvVar("PAGEDLLM_HUGE_PAGES", _switch, True,
           "0: the CPU weights stay where they were loaded, not copied into memory advised for "
           "transparent huge pages (model/huge_pages.py; for measurements)"),
    EnvVar("CXX", str, "c++", "the C++ compiler the kernels are built with"),
    EnvVar("PAGEDLLM_API_KEY", str, None,
           "`pagedllm serve`'s API key where --api-key and --api-key-file are not given",
           empty_is_unset=False),
    EnvVar("VLLM_API_KEY", str, None, "vLLM's name for the same, read after PAGEDLLM_API_KEY",
           empty_is_unset=False),
    # torchrun's (torch.distributed's env:// rendezvous reads them itself; these are for checks).
    EnvVar("RANK", _count, None, "this process's rank among a tensor-parallel launch"),
    EnvVar("WORLD_SIZE", _count, None, "how many ranks the launch has"),
    EnvVar("LOCAL_WORLD_SIZE", _count, 1, "how many of them run on this machine"),
    EnvVar("LOCAL_RANK", _count, None, "this process's rank among those on its machine (its GPU)"),
    EnvVar("MASTER_ADDR", str, None, "where rank 0's store listens"),
    EnvVar("MASTER_PORT", _count, None, "the port it listens on"),
)}

# Set by `pagedllm` before torch is imported, unless the user set them: OpenMP threads that spin
# forever between parallel regions collapse throughput when another process shares the cores; a
# bounded spin kept idle-machine speed and stayed fast under load (docs/benchmarks-notebook.md, CPU speed).
PROCESS_DEFAULTS = {"GOMP_SPINCOUNT": "100000"}


def __getattr__(name: str):
    """`envs.NAME`: the declared variable's current value."""
    if name not in VARIABLES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return read(name)


def read(name: str):
    var = VARIABLES[name]
    text = os.environ.get(name)
    if text is None or (text == "" and var.empty_is_unset):
        return var.default
    try:
        return var.parse(text)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={text!r}: expected {exc} ({var.meaning})") from None


def is_set(name: str) -> bool:
    return name in VARIABLES and os.environ.get(name, "") != ""


def apply_process_defaults() -> None:
    """PROCESS_DEFAULTS into this process's environment where the user left them unset (before
    torch, or OpenMP, is loaded: they read them once)."""
    for name, value in PROCESS_DEFAULTS.items():
        os.environ.setdefault(name, value)


def undeclared_pagedllm_variables() -> list[str]:
    """PAGEDLLM_* names set in the environment that pagedllm does not read (a typo, or a setting
    that moved to a flag), for one warning at start-up."""
    return sorted(name for name in os.environ if name.startswith("PAGEDLLM_")
                  and name not in VARIABLES and name not in _READ_ELSEWHERE)


# The engine core's test hooks (engine/core_process.py), on their way out of production code.
_READ_ELSEWHERE = ("PAGEDLLM_CORE_TEST_HOOKS",)


def pythonpath_with_this_package() -> str:
    """$PYTHONPATH with the folder holding this pagedllm first: a child process started with it
    (the engine core, a tensor-parallel worker, a kernel build) runs the same code as its parent,
    wherever that was imported from."""
    root = str(Path(__file__).resolve().parents[1])
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)


def child_environ(extra: dict[str, str] | None = None, *, this_package: bool = True) -> dict[str, str]:
    """The environment for a child process: this one's, with this pagedllm first on its path
    (unless this_package is False: a rival's interpreter), and extra on top."""
    env = dict(os.environ)
    if this_package:
        env["PYTHONPATH"] = pythonpath_with_this_package()
    env.update(extra or {})
    return env
