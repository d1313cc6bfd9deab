"""Which adapter a request runs with (vLLM's LoRARequest), and the name=path pairs of
--lora-modules. Plain data, no torch: it crosses the core's channel inside EngineCoreRequest.

An adapter is known by its whole identity, (name, id, path): the same three mean the same weights,
so requests naming them share prefix-cache blocks and one slot; anything else is another adapter
(the server gives every load a fresh id, so a name unloaded and loaded again from elsewhere never
meets the old one's blocks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's shape: LoRARequest(lora_name, lora_int_id, lora_path)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest: lora_name must be a non-empty string; got {self.lora_name!r}")
        lora_id = self.lora_int_id
        if isinstance(lora_id, bool) or not isinstance(lora_id, int) or lora_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be a positive integer; "
                             f"got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, os.PathLike)) or not str(self.lora_path):
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path must be a folder's path; "
                             f"got {self.lora_path!r}")
        object.__setattr__(self, "lora_path", os.fspath(self.lora_path))

    @property
    def key(self) -> str:
        """The adapter's identity as one string (it goes into the prefix cache's block hashes)."""
        return f"{self.lora_int_id}\x00{self.lora_name}\x00{self.lora_path}"


def parse_lora_modules(items: tuple[str, ...] | list[str]) -> dict[str, str]:
    """{name: path} of --lora-modules' name=path items; ValueError naming a bad or repeated one."""
    modules: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=") if isinstance(item, str) else ("", "", "")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules: {item!r} is not name=path (a PEFT adapter's folder)")
        if name.strip() in modules:
            raise ValueError(f"lora_modules: the name {name.strip()!r} is given twice")
        modules[name.strip()] = path.strip()
    return modules
