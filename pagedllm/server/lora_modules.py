"""The LoRA adapters a server offers, by the model name a request picks them with (vLLM's
--lora-modules, /v1/load_lora_adapter and /v1/unload_lora_adapter): the API process's list. No
torch here: the engine core reads and checks each adapter (at its start for --lora-modules, a bad
one stopping start-up in one line; for a load, before the name is offered: AsyncEngine.load_lora).

Every adapter gets a fresh id, so a name unloaded and loaded again from another folder is another
adapter to the core and its prefix cache. Unloading takes the name off this list: requests that
name it from then on are a 404, and the requests already sent finish with the adapter they started
with (they carry it; the core keeps it in its slot until none of them is left).
"""

from __future__ import annotations

import itertools

from pagedllm.lora.request import LoRARequest, parse_lora_modules


class LoRAModules:
    def __init__(self, modules: tuple[str, ...] = ()) -> None:
        """modules: --lora-modules' name=path items (ids 1, 2, ... in their order, as the core
        numbers them when it checks them at start)."""
        self._ids = itertools.count(1)
        self._adapters: dict[str, LoRARequest] = {}
        for name, path in parse_lora_modules(modules).items():
            self.add(self.new_request(name, path))

    def new_request(self, name: str, path: str) -> LoRARequest:
        """The adapter at path under name, with a fresh id (ValueError for a bad name or path)."""
        return LoRARequest(name, next(self._ids), path)

    def add(self, lora: LoRARequest) -> None:
        """Offer lora under its name; ValueError if the name is taken."""
        if lora.lora_name in self._adapters:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} is already loaded (unload it first)")
        self._adapters[lora.lora_name] = lora

    def remove(self, name: str) -> bool:
        """Stop offering name (the requests already sent finish); False if it was not offered."""
        return self._adapters.pop(name, None) is not None

    def get(self, name: str) -> LoRARequest | None:
        return self._adapters.get(name)

    def __iter__(self):
        return iter(list(self._adapters.values()))
