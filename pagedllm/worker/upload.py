"""The step packet's host buffer, and off the CPU its one copy to the device.

A step's integers (pagedllm.worker.packet) are written into one host buffer kept across steps. On
the CPU the model reads views of it (valid until the next step). Elsewhere the packet goes to the
device in one copy, from pinned memory where CUDA is really there (a fake device in tests has
none), and the next step waits for that copy to leave the buffer before rewriting it. The device's
copy of the block table lives here too: it follows the host's by the changed entries each packet
carries (a tensor-parallel worker keeps its copy of rank 0's table the same way, on any device).
"""

from __future__ import annotations

import numpy as np
import torch


class StepUpload:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.uploads = device.type != "cpu"  # whether packets go to a device
        self._pinned = self.uploads and device.type == "cuda" and torch.cuda.is_available()
        self._copied = torch.cuda.Event() if self._pinned else None
        self.host = np.zeros(0, dtype=np.int64)  # the host packet (a numpy view of host_tensor)
        self.host_tensor = torch.from_numpy(self.host)
        self._device_packet: torch.Tensor | None = None
        self._device_table: torch.Tensor | None = None

    def reserve(self, length: int) -> np.ndarray:
        """The host packet, free to rewrite and at least length integers long."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has left the pinned buffer
        if length > len(self.host):
            size = max(length, 2 * len(self.host))
            if self._pinned:
                self.host_tensor = torch.empty(size, dtype=torch.int64, pin_memory=True)
                self.host = self.host_tensor.numpy()
            else:
                self.host = np.zeros(size, dtype=np.int64)
                self.host_tensor = torch.from_numpy(self.host)
            if self.uploads:
                self._device_packet = torch.empty(size, dtype=torch.int64, device=self.device)
        return self.host

    def upload(self, length: int) -> torch.Tensor:
        """The first length integers of the host packet, on the device, in one copy."""
        device_packet = self._device_packet[:length]
        device_packet.copy_(self.host_tensor[:length], non_blocking=self._pinned)
        if self._copied is not None:
            self._copied.record()
        return device_packet

    def update_table(self, changes: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """The device's block table with a packet's changed entries (flat indices, then values, on
        the device) written in; reallocated (contents kept) when the host's, now shaped `shape`,
        grew."""
        if self._device_table is None:
            self._device_table = torch.zeros(shape, dtype=torch.int32, device=self.device)
        if self._device_table.shape != shape:
            grown = torch.zeros(shape, dtype=torch.int32, device=self.device)
            rows, cols = self._device_table.shape
            grown[:rows, :cols] = self._device_table
            self._device_table = grown
        count = changes.numel() // 2
        if count:
            self._device_table.view(-1).index_copy_(0, changes[:count], changes[count:].to(torch.int32))
        return self._device_table
