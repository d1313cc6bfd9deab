"""The engine core's side of LoRA: which adapter a new request gets, in which slot of the model.

A request names its adapter with a LoRARequest (name, id, path). Adapters are read from their
folders when first asked for and kept read, up to max_cpu_loras, least recently used dropped first
(reading again costs a disk read, nothing else). The model has max_loras slots (lora/manager.py):
an adapter stays in its slot while any unfinished request uses it, so a request's slot holds for
its whole life, preemption and recompute included. A request for an adapter that has no slot takes
a free one, or the least recently used slot that no unfinished request uses; when every slot is
held by unfinished requests' adapters it gets none yet and waits (pagedllm.engine.lora_admission).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from pagedllm.lora.adapter import LoRAAdapter
from pagedllm.lora.manager import LoRAManager
from pagedllm.lora.request import LoRARequest
from pagedllm.model.config import ModelConfig


class LoRASlots:
    def __init__(self, manager: LoRAManager, base: ModelConfig, max_cpu_loras: int) -> None:
        self.manager = manager
        self.base = base
        self.max_cpu_loras = max_cpu_loras
        self._read: OrderedDict[str, LoRAAdapter] = OrderedDict()  # key -> adapter, oldest use first
        self._slotted: OrderedDict[str, int] = OrderedDict()  # key -> slot, oldest use first

    def acquire(self, lora: LoRARequest, keys_in_use: Callable[[], Iterable[str]]) -> int | None:
        """The slot of lora's adapter, read and put in a slot now if it has none; None if every
        slot holds an adapter in use; LoRAError (a ValueError, one line naming the adapter) if it
        cannot be read. keys_in_use: the adapters of the unfinished requests (asked only when a
        slot must be freed)."""
        key = lora.key
        if key in self._slotted:
            self._slotted.move_to_end(key)
            return self._slotted[key]
        adapter = self.read(lora)
        if len(self._slotted) >= self.manager.max_loras and not self._free_one_slot(set(keys_in_use())):
            return None
        slot = self.manager.add(adapter, key)
        self._slotted[key] = slot
        return slot

    def read(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter, from memory or its folder (checked against the base model)."""
        key = lora.key
        if key in self._read:
            self._read.move_to_end(key)
            return self._read[key]
        adapter = LoRAAdapter.load(lora.lora_name, lora.lora_path, self.base, self.manager.max_rank)
        self._read[key] = adapter
        while len(self._read) > self.max_cpu_loras:
            self._read.popitem(last=False)
        return adapter

    def _free_one_slot(self, in_use: set[str]) -> bool:
        """Empty the least recently used slot whose adapter no unfinished request uses, if any."""
        idle = next((key for key in self._slotted if key not in in_use), None)
        if idle is None:
            return False
        del self._slotted[idle]
        self.manager.remove(idle)
        return True

    @property
    def num_read(self) -> int:
        return len(self._read)

    def slotted(self) -> list[str]:
        """The keys of the adapters in slots now, least recently used first."""
        return list(self._slotted)
