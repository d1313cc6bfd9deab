"""Which requests of LoRA adapters may run now: the engine core's side of --max-loras.

A new request of an adapter gets the adapter's slot in the model (pagedllm.lora.slots: read and
slotted now if need be) and goes to the scheduler; a bad adapter refuses the request at once, in
one line naming it. When every slot holds an adapter that unfinished requests use, the request
waits here, in the core's map but outside the scheduler (as one whose grammar still compiles), and
is handed over at the start of a later step, once the requests of some slotted adapter have all
finished. So a step never holds more than max_loras adapters, and the scheduler knows nothing of
them.
"""

from __future__ import annotations

import logging

from pagedllm.engine.core_requests import CoreRequests
from pagedllm.engine.messages import EngineCoreOutput, EngineCoreRequest
from pagedllm.engine.request_group import CoreSequence
from pagedllm.lora.adapter import LoRAError
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.slots import LoRASlots

logger = logging.getLogger(__name__)


class LoRAAdmission:
    def __init__(self, slots: LoRASlots | None, requests: CoreRequests) -> None:
        self.slots = slots
        self.requests = requests
        self.waiting: list[CoreSequence] = []  # first sequences waiting for a slot, in arrival order

    def assign(self, request: EngineCoreRequest, first: CoreSequence) -> bool:
        """Give the request's first sequence its adapter's slot; False if it must wait for one.
        ValueError (nothing kept) if LoRA is off or the adapter cannot be read."""
        if request.lora is None:
            return True
        self._check_on(request.lora)
        slot = self.slots.acquire(request.lora, self._keys_in_use)
        first.request.lora_slot = -1 if slot is None else slot
        return slot is not None

    def read(self, lora: LoRARequest) -> None:
        """Read and check lora's adapter now (kept read); ValueError if it cannot be served."""
        self._check_on(lora)
        self.slots.read(lora)

    def _check_on(self, lora: LoRARequest) -> None:
        if self.slots is None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} asked for, but LoRA is off "
                             "(start the engine with enable_lora / --enable-lora)")

    def wait(self, first: CoreSequence) -> None:
        self.waiting.append(first)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def admit_waiting(self) -> tuple[list[CoreSequence], list[EngineCoreOutput]]:
        """The waiting sequences that have a slot now (for the scheduler), and an "abort" for
        each output of those whose adapter could not be read again (its folder changed)."""
        admitted, refused, still = [], [], []
        for first in self.waiting:
            request_id = first.request.request_id
            if self.requests.seqs.get(request_id) is not first:  # aborted meanwhile
                continue
            try:
                ready = self.assign(first.group.request, first)
            except LoRAError as exc:
                logger.error("request %s: %s", request_id, exc)
                self.requests.forget(first.group)
                refused += [EngineCoreOutput(request_id, i, [], finish_reason="abort")
                            for i in range(first.group.request.sampling_params.n)]
                continue
            (admitted if ready else still).append(first)
        self.waiting = still
        return admitted, refused

    def _keys_in_use(self) -> set[str]:
        return {seq.request.lora_key for seq in self.requests.seqs.values()
                if seq.request.lora_slot >= 0}
