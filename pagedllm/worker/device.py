"""The torch device the engine runs on (`--device auto|cpu|cuda[:N]`), and what depends on it."""

from __future__ import annotations

import torch

from pagedllm.config import check_device_name


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """"auto" is the first CUDA GPU where one is usable, else the CPU. Asking for CUDA where it
    cannot be had raises ValueError with one line saying why."""
    if isinstance(name, torch.device):
        name = str(name)
    check_device_name(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: CUDA is not available here ({_why_no_cuda()}); "
                             "use --device cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: there are {torch.cuda.device_count()} CUDA devices "
                             f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return device


def _why_no_cuda() -> str:
    if torch.version.cuda is None:
        return f"this torch build, {torch.__version__}, has no CUDA support"
    return "no CUDA GPU is visible to this process"
