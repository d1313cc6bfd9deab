"""The engine's device: choosing it, refusing CUDA where there is none, and, on a machine without a
GPU, a model step run on fake CUDA tensors (torch's FakeTensorMode: shapes, dtypes and devices,
no data) so that a tensor left on the CPU, or a value read back to the host in the middle of the
layers, fails here rather than on the first GPU it meets."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import ScheduledRequest
from pagedllm.kernels.attention import torch_ref
from pagedllm.model import llama
from pagedllm.model.loader import load_model
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.device import resolve_device
from pagedllm.worker.runner import ModelRunner
from pagedllm.worker.sampler import Sampler, _candidates, _inverse_cdf, _weights

# -- choosing the device ---------------------------------------------------------------------


def test_auto_is_cuda_only_where_there_is_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_cuda_without_cuda_fails_with_one_clear_line(monkeypatch, name):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available") as info:
        resolve_device(name)
    assert "\n" not in str(info.value) and "--device cpu" in str(info.value)


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "CPU", "", "mps", 0])
def test_unknown_device_names_are_refused(name):
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(device=name)


def test_cli_device_cuda_without_cuda(monkeypatch, capsys):
    """`pagedllm generate --device cuda` on a machine without CUDA: exit 2 and one line, before any
    model is loaded."""
    from pagedllm import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("pagedllm.engine.core_loader.load_engine_model",
                        lambda *a, **k: pytest.fail("loaded a model"))
    assert cli.main(["generate", "hello", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pagedllm: error: device 'cuda': CUDA is not available")


# -- a step on a fake device -----------------------------------------------------------------
#
# A CPU-only torch cannot fake CUDA tensors all the way (indexing one needs a CUDA device guard it
# lacks), so the stand-in device is "meta" under FakeTensorMode: there every op checks that its
# tensors share one device (a CPU tensor meeting a device one raises, as it would on a GPU), and any
# read of a value back to the host (.item(), .tolist(), a data-dependent shape) raises too.
# One quirk is worked around: torch.tensor(data, device="meta") under the mode makes a real meta
# tensor that the mode then refuses, so it is made as on a GPU: on the host, then copied over.

pytest.importorskip("transformers")
from tests.model.tiny import make_hf_model, save_checkpoint  # noqa: E402
from tests.worker.test_sampler import row  # noqa: E402

DEVICE = torch.device("meta")
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Mistral (GQA, sliding window, linear rope scaling)."""
    return save_checkpoint(make_hf_model("mistral_linear_rope_window"), tmp_path_factory.mktemp("tiny"))


def scheduled_step() -> list[ScheduledRequest]:
    """A fresh prefill, a chunk after cached context that does not sample, and two decodes."""
    shapes = [(0, 11, 11), (8, 6, 30), (20, 1, 21), (5, 1, 6)]  # (computed, new, known tokens)
    step, next_block = [], 0
    for i, (computed, new, known) in enumerate(shapes):
        num_blocks = -(-(computed + new) // BLOCK_SIZE)
        blocks = list(range(next_block, next_block + num_blocks))[::-1]
        next_block += num_blocks
        request = SimpleNamespace(request_id=f"r{i}", token_ids=[7] * known, num_tokens=known)
        step.append(ScheduledRequest(request, new, computed, blocks, BLOCK_SIZE))
    return step


@contextmanager
def fake_device():
    """FakeTensorMode for a step on DEVICE. Real host tensors may enter (the step's host packet is
    real; it is copied over), but every op still checks that its tensors share a device."""
    real_tensor = torch.tensor

    def tensor_via_host(data, *, device=None, **kwargs):
        return real_tensor(data, **kwargs).to(device if device is not None else "cpu")

    with FakeTensorMode(allow_non_fake_inputs=True) as mode, \
            pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "tensor", tensor_via_host)
        yield mode


@pytest.fixture(params=["triton", "torch"])
def attention_on_device(request, monkeypatch):
    """The attention the dispatcher takes for CUDA tensors: the Triton op (its fake implementation
    runs here, checking its inputs' devices) or, without Triton, the portable torch path."""
    if request.param == "torch":
        monkeypatch.setattr(llama, "paged_attention", torch_ref.paged_attention)
        return
    pytest.importorskip("triton", reason="triton is not installed: pip install triton")
    from pagedllm.kernels.attention import triton_attention

    monkeypatch.setattr(llama, "paged_attention", triton_attention.paged_attention)


def fake_device_runner(checkpoint) -> ModelRunner:
    model = load_model(checkpoint, "float32", device=DEVICE).model
    assert {t.device for t in [*model.parameters(), *model.buffers()]} == {DEVICE}
    with fake_device():
        return ModelRunner(model, num_blocks=32, block_size=BLOCK_SIZE,
                           max_num_batched_tokens=64, max_model_len=128, kv_dtype=torch.float32,
                           device=DEVICE)


def test_a_step_keeps_every_tensor_on_the_device_and_never_syncs(checkpoint, attention_on_device):
    runner = fake_device_runner(checkpoint)
    with fake_device():
        logits, sample_indices, _ = runner.execute(scheduled_step())
    assert sample_indices == [0, 2, 3]
    assert logits.device == DEVICE and logits.shape == (3, 300) and logits.dtype == torch.float32


def test_the_check_finds_a_tensor_left_on_the_host(checkpoint, attention_on_device, monkeypatch):
    """The harness above is not vacuous: step inputs left in host memory make the step fail."""
    runner = fake_device_runner(checkpoint)
    monkeypatch.setattr(runner.upload, "upload", lambda length: runner.upload.host_tensor[:length])
    with fake_device(), pytest.raises(Exception, match="device"):
        runner.execute(scheduled_step())


def test_the_check_finds_a_host_read_in_the_layers(checkpoint, attention_on_device, monkeypatch):
    runner = fake_device_runner(checkpoint)
    mlp = runner.model.layers[1].mlp
    forward = mlp.forward
    monkeypatch.setattr(mlp, "forward", lambda x: forward(x) * float(x.abs().max()))
    with fake_device(), pytest.raises(Exception, match="_local_scalar_dense"):
        runner.execute(scheduled_step())



def test_sampling_math_stays_on_the_device():
    """Penalties, early-stop bans, top-k/top-p, min-p, greedy choice and logprob ranks on device
    logits; only the final hand-over of ids (one .tolist()) reads back."""
    sampler = Sampler(seed=0)
    params = [SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5,
                             frequency_penalty=0.2),
              SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, min_tokens=3)]
    rows = [row(params[0], [1, 2, 3], [4, 4, 299], ()), row(params[1], [5], [6], (9, 11))]
    with fake_device():
        logits = torch.empty(2, 300, device=DEVICE)
        processed = sampler._ban_early_stops(sampler._apply_penalties(logits, rows), rows)
        ((group, values, token_ids),) = _candidates(processed[1:] / 0.7, params[1:])
        filtered = _weights(values, params[1:])
        picked = _inverse_cdf(filtered, torch.rand(1, dtype=torch.float64, device=DEVICE))
        greedy = sampler._choose(processed[:1], rows[:1])
        with pytest.raises(Exception, match="_local_scalar_dense"):
            greedy.tolist()
    assert {processed.device, filtered.device, picked.device, token_ids.device, greedy.device} == {DEVICE}
