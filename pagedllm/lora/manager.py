"""Which adapters are loaded, in which slots: added and removed at runtime (vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter), the slot's weights written into every wrapped
projection (lora/layers.py) and zeroed when it is freed, so a freed slot holds nothing of the old
adapter and memory stays what max_loras sized at load."""

from __future__ import annotations

from pagedllm.lora.adapter import PART_OF, LoRAAdapter, LoRAError
from pagedllm.lora.layers import LoRALinear, LoRAState


class LoRAManager:
    def __init__(self, state: LoRAState, wrapped: dict[tuple[int, str], LoRALinear], max_loras: int,
                 max_rank: int) -> None:
        self.state = state
        self.wrapped = wrapped
        self.max_loras = max_loras
        self.max_rank = max_rank
        self._slots: dict[str, int] = {}  # adapter key (its name unless given one) -> slot

    @property
    def names(self) -> list[str]:
        return list(self._slots)

    def slot_of(self, name: str) -> int:
        if name not in self._slots:
            raise KeyError(name)
        return self._slots[name]

    def add(self, adapter: LoRAAdapter, key: str | None = None) -> int:
        """Load adapter into a free slot (its slot) under key (default: its name); LoRAError if the
        key is taken or no slot is free."""
        key = adapter.name if key is None else key
        if key in self._slots:
            raise LoRAError(f"LoRA adapter {adapter.name!r} is already loaded")
        if adapter.rank > self.max_rank:
            raise LoRAError(f"LoRA adapter {adapter.name!r}: rank {adapter.rank} exceeds "
                            f"--max-lora-rank {self.max_rank}")
        free = sorted(set(range(self.max_loras)) - set(self._slots.values()))
        if not free:
            raise LoRAError(f"LoRA adapter {adapter.name!r}: all {self.max_loras} slots are taken "
                            "(--max-loras); unload one first")
        slot = free[0]
        by_module: dict[tuple[int, str], dict] = {}
        for (layer, module), pair in adapter.weights.items():
            ours, part = PART_OF[module]
            if (layer, ours) not in self.wrapped:
                raise LoRAError(f"LoRA adapter {adapter.name!r}: layer {layer} {module} is not a "
                                "LoRA target of this model")
            by_module.setdefault((layer, ours), {})[part] = pair
        for target, module in self.wrapped.items():
            if target in by_module:
                module.set_slot(slot, by_module[target], adapter.scaling)
            else:
                module.clear_slot(slot)
        self._slots[key] = slot
        return slot

    def remove(self, name: str) -> None:
        slot = self._slots.pop(name)
        for module in self.wrapped.values():
            module.clear_slot(slot)
