"""The model's CPU weights in one mapping that Linux backs with 2 MiB pages.

A decode step of a few rows streams every weight once from memory, and on a CPU it is bound by how
fast that stream runs. Loaded weights lie in many allocations, most of them under 2 MiB (an expert's
projection, a layer's norm), which the allocator places in 4 KiB pages: a 200 MB model spans some
50,000 pages, far more than the TLB holds, so reads wait on page walks, and the hardware prefetcher
stops at each page's end. With transparent huge pages in "madvise" mode (the common default) none of
that memory gets 2 MiB pages unless it asks.

move_weights_to_huge_pages() asks: after the model is loaded and laid out for the kernels, it copies
every strided CPU tensor the model's modules hold (parameters, buffers, and tensors in plain
attributes, lists, dicts and dataclasses: QuantizedWeight's codes and scales) into one private
anonymous mapping advised MADV_HUGEPAGE, in the order model.modules() lists them (layer by layer,
so what a step reads next lies next), and points each tensor at its copy with Tensor.set_ (every
holder of that tensor object sees the move; tied weights, which share a storage, stay shared, and
views of one storage keep their offsets). The old allocations are freed and malloc_trim hands their
pages back, so resident memory does not grow. Tensors made from a weight before the move (a view
taken into a list elsewhere) keep the old memory: call it before such views are made (ModelRunner
calls it before DecodeLayers packs the layers).

Off with PAGEDLLM_HUGE_PAGES=0; nothing is done off Linux, where transparent huge pages are
"never", for a model with no CPU tensors, or where the weights are more than half the memory
still available (the copy is made before the old pages go back; available_memory). The KV cache
is not moved (it is allocated after). Measured: docs/cpu-tiers.md, "Weights in huge pages".
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from pagedllm import envs
from pagedllm.utils import release_freed_memory

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # each storage's copy starts on a cache line, as the CPU allocator's do
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclass(frozen=True)
class Moved:
    bytes: int
    storages: int
    tensors: int


def huge_pages_available() -> bool:
    """Whether this process can ask for transparent huge pages (Linux, not set to "never")."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _THP_SETTING.read_text()
    except OSError:
        return False


def move_weights_to_huge_pages(model: torch.nn.Module) -> Moved | None:
    """Copy the model's CPU tensors into one huge-page-advised mapping (the module docstring);
    None where nothing was moved."""
    if not isinstance(model, torch.nn.Module) or not envs.PAGEDLLM_HUGE_PAGES or not huge_pages_available():
        return None  # (a bench's stand-in runner model holds no weights)
    by_storage = _tensors_by_storage(model)
    if not by_storage:
        return None
    spans = {ptr: _span(tensors) for ptr, tensors in by_storage.items()}
    offsets, total = {}, 0
    for ptr, (start, end) in spans.items():
        offsets[ptr] = total
        total += -(-(end - start) // ALIGN) * ALIGN
    available = available_memory()
    if total > available // 2:
        logger.info("weights left in 4 KiB pages: moving %.0f MiB needs as much free memory again "
                    "(%.0f MiB available)", total / 2**20, available / 2**20)
        return None
    arena = _huge_page_arena(total)
    storage = arena.untyped_storage()
    with torch.no_grad():
        for ptr, tensors in by_storage.items():
            start, end = spans[ptr]
            at = arena.storage_offset() + offsets[ptr]
            old = torch.empty(0, dtype=torch.uint8).set_(tensors[0].untyped_storage())
            arena[offsets[ptr]:offsets[ptr] + end - start].copy_(old[start:end])
            for t in tensors:
                size = t.element_size()
                t.set_(storage, (at + t.storage_offset() * size - start) // size, t.size(), t.stride())
    release_freed_memory()  # the old weights' pages: glibc keeps freed heap memory mapped
    moved = Moved(total, len(by_storage), sum(len(t) for t in by_storage.values()))
    logger.debug("weights moved to huge pages: %s", moved)
    return moved


def available_memory() -> int:
    """Bytes the system can still give. Each storage's old pages go back as soon as its copy is
    made, but a holder this module does not find would keep both: the move needs the weights'
    size free, with room to spare."""
    return psutil.virtual_memory().available


def _tensors_by_storage(model: torch.nn.Module) -> dict[int, list[torch.Tensor]]:
    """Every strided CPU tensor object the model's modules hold, grouped by the storage under it."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    for module in model.modules():
        for value in vars(module).values():
            _collect(value, seen, found)
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in found:
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    return by_storage


def _collect(value: object, seen: set[int], found: list[torch.Tensor], depth: int = 0) -> None:
    if id(value) in seen or depth > 8 or isinstance(value, torch.nn.Module):
        return  # a module is visited by model.modules()
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        if (value.device.type == "cpu" and value.layout == torch.strided and not value.is_mkldnn
                and value.untyped_storage().nbytes() > 0):
            found.append(value)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, seen, found, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, seen, found, depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _collect(getattr(value, field.name), seen, found, depth + 1)


def _span(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """The bytes of their storage the tensors reach: [first, end), the first rounded down to ALIGN
    (so every tensor's offset from it stays a whole number of its elements). Only those are copied
    (a tensor may view a small part of a large buffer)."""
    start = min(t.storage_offset() * t.element_size() for t in tensors) // ALIGN * ALIGN
    end = max(_end_byte(t) for t in tensors)
    return start, end


def _end_byte(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return t.storage_offset() * t.element_size()
    last = sum((n - 1) * s for n, s in zip(t.size(), t.stride()))
    return (t.storage_offset() + last + 1) * t.element_size()


def _huge_page_arena(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] in a private anonymous mapping advised MADV_HUGEPAGE, starting on a huge page
    (the mapping lives as long as a tensor viewing it)."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]

