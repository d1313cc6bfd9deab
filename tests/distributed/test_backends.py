"""Which collectives a tensor-parallel group uses, checked without GPUs: gloo on the CPU (the path
test_tensor_parallel.py runs end to end), NCCL beside it for CUDA tensors with one GPU per rank,
and clear refusals (a torch without NCCL, too few GPUs, a device no backend runs on). The NCCL
group is a stand-in here that records what it is asked; a machine with several GPUs runs the real
one."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pagedllm.config import EngineConfig
from pagedllm.distributed import driver
from pagedllm.distributed.group import TensorParallelGroup, backend_for, rank_device


def test_backend_by_device(monkeypatch):
    assert backend_for(torch.device("cpu")) == "gloo"
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert backend_for(torch.device("cuda", 1)) == "nccl"
    with pytest.raises(ValueError, match="CPU \\(gloo\\) or CUDA GPUs \\(NCCL\\); got device meta"):
        backend_for(torch.device("meta"))


def test_cuda_without_nccl_is_refused(monkeypatch):
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(ValueError, match="needs NCCL.*use --device cpu"):
        backend_for(torch.device("cuda"))


@pytest.mark.parametrize("device,local_rank,expected", [
    ("cpu", 3, "cpu"), ("cuda", 0, "cuda:0"), ("cuda", 1, "cuda:1"), ("cuda:2", 1, "cuda:3"),
    ("cuda:0", 7, "cuda:7")])
def test_one_gpu_per_rank_from_rank_zeros_on(device, local_rank, expected):
    assert rank_device(torch.device(device), local_rank) == torch.device(expected)


class FakeNCCL:
    """Records the group it was made as and the collectives it was asked for."""

    made: list = []

    class Options:
        _timeout = None

    def __init__(self, store, rank, size, options) -> None:
        self.calls: list[str] = []
        FakeNCCL.made.append((rank, size, options._timeout, self))

    def allreduce(self, tensors):
        self.calls.append("allreduce")
        return _Done()

    def allgather(self, outputs, inputs):
        self.calls.append("allgather")
        outputs[0][0].copy_(inputs[0])
        return _Done()


class _Done:
    def wait(self):
        return True


@pytest.fixture
def fake_nccl(monkeypatch):
    FakeNCCL.made = []
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    return FakeNCCL


def test_a_cuda_group_sends_device_tensors_to_nccl_and_host_ones_to_gloo(fake_nccl):
    """A group of one rank (a real gloo group over a hash store, the NCCL stand-in beside it):
    device tensors (meta, standing for CUDA ones) go to NCCL, the steps' host packets to gloo."""
    tp = TensorParallelGroup(dist.HashStore(), 0, 1, timeout_s=7.0, device=torch.device("cuda", 0))
    assert tp.backend == "nccl"
    ((rank, size, timeout, nccl),) = fake_nccl.made
    assert (rank, size, timeout) == (0, 1, timedelta(seconds=7))
    tp.all_reduce(torch.empty(4, device="meta"))
    parts = tp.gather(torch.empty(2, 3, device="meta"))
    assert nccl.calls == ["allreduce", "allgather"] and len(parts) == 1
    host = torch.arange(5)
    tp.broadcast(host)  # the step header and packet: gloo
    tp.all_reduce(host)
    assert nccl.calls == ["allreduce", "allgather"] and host.tolist() == [0, 1, 2, 3, 4]
    assert tp.num_all_reduces == 2


def test_a_cpu_group_has_no_nccl(fake_nccl):
    tp = TensorParallelGroup(dist.HashStore(), 0, 1, timeout_s=7.0)
    assert tp.backend == "gloo" and not fake_nccl.made
    tensor = torch.ones(3)
    tp.all_reduce(tensor)
    assert tensor.tolist() == [1, 1, 1] and tp.gather(tensor)[0].tolist() == [1, 1, 1]


def test_tensor_parallel_on_cuda_needs_a_gpu_per_rank(monkeypatch):
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    config = EngineConfig(tensor_parallel_size=4)
    with pytest.raises(ValueError, match="takes GPUs 0 to 3 \\(one per rank\\); this machine has 2"):
        driver.load_engine_model(config, torch.device("cuda", 0))
    with pytest.raises(ValueError, match="takes GPUs 1 to 2"):
        driver.load_engine_model(EngineConfig(tensor_parallel_size=2), torch.device("cuda", 1))


def test_tensor_parallel_on_cuda_starts_the_workers(monkeypatch):
    """Where the GPUs are there, CUDA is no longer refused: the driver starts its workers on them
    (stopped here at that point)."""
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(driver, "read_model_config", lambda model: None)
    monkeypatch.setattr(driver, "ShardPlan", lambda config, size: None)

    def start(config, device):
        raise RuntimeError(f"starting {config.tensor_parallel_size} ranks from {device}")

    monkeypatch.setattr(driver.TensorParallelDriver, "start", staticmethod(start))
    with pytest.raises(RuntimeError, match="starting 2 ranks from cuda:0"):
        driver.load_engine_model(EngineConfig(tensor_parallel_size=2), torch.device("cuda", 0))

