"""The LoRA adapters a server offers, by the model name a request picks them with (vLLM's
--lora-modules, /v1/load_lora_adapter and /v1/unload_lora_adapter): the API process's list.

Each adapter is read and checked against the base model when it is added (at start-up, or by
/v1/load_lora_adapter), so a bad one is refused there, in one line naming it; the engine core reads
it again when a request first needs it (pagedllm.lora.slots). Every load gets a fresh id, so a name
unloaded and loaded again from another folder is another adapter to the core and its prefix cache.

Unloading takes the name off this list: requests that name it from then on are a 404, and the
requests already sent finish with the adapter they started with (they carry it; the core keeps it
in its slot until none of them is left).
"""

from __future__ import annotations

import itertools

from pagedllm.lora.adapter import LoRAAdapter
from pagedllm.lora.request import LoRARequest, parse_lora_modules
from pagedllm.model.config import ModelConfig


class LoRAModules:
    def __init__(self, base: ModelConfig, max_rank: int, modules: tuple[str, ...] = ()) -> None:
        """modules: --lora-modules' name=path items, each read and checked now (LoRAError, one
        line naming it)."""
        self.base = base
        self.max_rank = max_rank
        self._ids = itertools.count(1)
        self._adapters: dict[str, LoRARequest] = {}
        for name, path in parse_lora_modules(modules).items():
            self.add(name, path)

    def add(self, name: str, path: str, checked: bool = False) -> LoRARequest:
        """Offer the adapter at path as name (checked: check(name, path) passed already);
        LoRAError (a ValueError) if it cannot be served, ValueError if the name is taken."""
        if name in self._adapters:
            raise ValueError(f"LoRA adapter {name!r} is already loaded (unload it first)")
        if not checked:
            self.check(name, path)
        self._adapters[name] = LoRARequest(name, next(self._ids), path)
        return self._adapters[name]

    def check(self, name: str, path: str) -> None:
        """Read the adapter and check it against the base model (the core reads it again)."""
        LoRAAdapter.load(name, path, self.base, self.max_rank)

    def remove(self, name: str) -> bool:
        """Stop offering name (the requests already sent finish); False if it was not offered."""
        return self._adapters.pop(name, None) is not None

    def get(self, name: str) -> LoRARequest | None:
        return self._adapters.get(name)

    def __iter__(self):
        return iter(list(self._adapters.values()))
