"""CUDA graphs of decode steps, checked where there is no GPU: the bucketing of batch sizes, and
the runner's graph path with a stand-in for CUDA's graph capture that reruns the recorded forward
pass on the views it was recorded with, into the output it first wrote. What a real graph would get
wrong, it gets wrong too: a value read on the host at capture (it stays what it was then), a static
buffer replaced instead of updated in place (the recorded views keep the old one). The model is a
tiny random Llama with the Triton attention kernel on its interpreter (the kernel the graphs
capture on CUDA), and every step is compared with an eager runner's. On a GPU (`make gpu-check`),
the same comparison runs with real CUDA graphs."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest
import torch

from pagedllm.config import EngineConfig, add_engine_args, engine_config_from_args
from pagedllm.core.scheduler import ScheduledRequest
from pagedllm.kernels.attention.metadata import AttentionMetadata
from pagedllm.worker import cuda_graphs
from pagedllm.worker.cuda_graphs import DecodeGraphs, capture_sizes, padded_size
from pagedllm.worker.runner import ModelRunner

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
BLOCK_SIZE = 4


# -- which batch sizes are captured ----------------------------------------------------------------

def test_capture_sizes():
    assert capture_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 8]  # 5 requests pad to 8
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 48]
    assert capture_sizes(1000)[-1] == cuda_graphs.MAX_CAPTURE_SIZE


@pytest.mark.parametrize("num_seqs,expected", [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (16, 16),
                                               (17, 32), (48, 48), (49, None)])
def test_a_step_is_padded_to_the_next_captured_size(num_seqs, expected):
    assert padded_size(num_seqs, capture_sizes(48)) == expected


def test_every_batch_up_to_max_num_seqs_has_a_graph():
    for max_num_seqs in range(1, 300):
        sizes = capture_sizes(max_num_seqs)
        assert sizes == sorted(set(sizes))
        largest = min(max_num_seqs, cuda_graphs.MAX_CAPTURE_SIZE)
        assert all(padded_size(n, sizes) is not None for n in range(1, largest + 1))


# -- enforce_eager -----------------------------------------------------------------------------------

def test_enforce_eager_is_an_engine_setting_and_a_flag():
    import argparse

    assert EngineConfig().enforce_eager is False
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--enforce-eager"])).enforce_eager is True
    assert engine_config_from_args(parser.parse_args([])).enforce_eager is False
    with pytest.raises(ValueError, match="enforce_eager must be true or false"):
        EngineConfig(enforce_eager="yes")


# -- the graph path through the runner ---------------------------------------------------------------

class ReplayedForward:
    """A stand-in for CudaGraphCapture: 'capturing' runs the forward pass once and keeps its
    output; a replay reruns it (on the views it was recorded with) into that same output."""

    def __init__(self) -> None:
        self.num_captures = 0

    def capture(self, forward):
        self.num_captures += 1
        out = forward()
        return (lambda: out.copy_(forward())), out


def graph_capture() -> cuda_graphs.GraphCapture:
    return cuda_graphs.CudaGraphCapture(DEVICE) if ON_GPU else ReplayedForward()


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    pytest.importorskip("transformers")
    from pagedllm.model.loader import load_model
    from tests.model.tiny import make_hf_model, save_checkpoint

    def load(shape: str):
        folder = save_checkpoint(make_hf_model(shape), tmp_path_factory.mktemp(shape))
        return load_model(folder, dtype="float32", device=DEVICE).model

    return {shape: load(shape) for shape in ("mistral_linear_rope_window", "llama_dynamic_rope")}


@pytest.fixture
def tiny_model(tiny_models):
    """A tiny Mistral: GQA, a sliding window, linear rope scaling."""
    return tiny_models["mistral_linear_rope_window"]


@pytest.fixture
def triton_attention(monkeypatch):
    """The model's attention through the Triton kernel (on its interpreter without a GPU)."""
    if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set")
    pytest.importorskip("triton")
    from pagedllm.kernels.attention import triton_attention as kernel
    from pagedllm.model import llama

    monkeypatch.setattr(llama, "paged_attention", kernel.paged_attention)


def make_runner(model, *, graphs: bool, num_blocks: int = 40, max_num_seqs: int = 8) -> ModelRunner:
    return ModelRunner(model, num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=64,
                       max_model_len=64, kv_dtype=torch.float32, device=DEVICE, max_num_seqs=max_num_seqs,
                       enforce_eager=not graphs, graph_capture=graph_capture() if graphs else None)


class Sequences:
    """A few requests driven through a runner, greedy: prefills, decode steps of changing batches
    (with new blocks taken on the way), one request finishing. Blocks come in shuffled order."""

    def __init__(self, runner: ModelRunner, num_blocks: int) -> None:
        self.runner = runner
        self.free = list(range(num_blocks))
        random.Random(0).shuffle(self.free)
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.logits: list[torch.Tensor] = []

    def add(self, request_id: str, prompt: list[int]) -> None:
        self.tokens[request_id], self.blocks[request_id], self.computed[request_id] = list(prompt), [], 0

    def step(self, request_ids: list[str]) -> None:
        batch = []
        for rid in request_ids:
            new = len(self.tokens[rid]) - self.computed[rid]
            while len(self.blocks[rid]) * BLOCK_SIZE < len(self.tokens[rid]):
                self.blocks[rid].append(self.free.pop())
            request = SimpleNamespace(request_id=rid, token_ids=self.tokens[rid],
                                      num_tokens=len(self.tokens[rid]))
            batch.append(ScheduledRequest(request, new, self.computed[rid], list(self.blocks[rid]),
                                          BLOCK_SIZE))
        logits, sample_indices, _ = self.runner.execute(batch)
        self.logits.append(logits.float().cpu())
        for row, i in enumerate(sample_indices):
            rid = request_ids[i]
            self.computed[rid] = len(self.tokens[rid])
            self.tokens[rid].append(int(logits[row].argmax()))

    def finish(self, request_id: str) -> None:
        self.runner.drop_requests([SimpleNamespace(request_id=request_id)])
        self.free += self.blocks.pop(request_id)


def drive(runner: ModelRunner, num_blocks: int) -> Sequences:
    seqs = Sequences(runner, num_blocks)
    seqs.add("a", [5, 9, 20, 33, 41, 7, 7, 100, 3, 18, 2])
    seqs.add("b", [77, 1, 250, 4, 4])
    seqs.step(["a", "b"])  # prefills: eager
    for _ in range(3):
        seqs.step(["a", "b"])  # 2 decodes: the graph of 2
    seqs.add("c", [12] * 7)
    seqs.step(["c"])  # a prefill alone: eager
    for _ in range(5):
        seqs.step(["a", "b", "c"])  # 3 decodes, padded to 4; new blocks on the way
    seqs.finish("b")  # c moves into b's row
    for _ in range(3):
        seqs.step(["a", "c"])
    seqs.add("d", [3, 1, 4, 1, 5])
    seqs.step(["a", "c", "d"])  # decodes and a prefill in one step: eager
    for _ in range(2):
        seqs.step(["d", "a", "c"])  # scheduled out of row order
    return seqs


def test_graph_runner_matches_the_eager_runner(tiny_model, triton_attention):
    eager = drive(make_runner(tiny_model, graphs=False), 40)
    runner = make_runner(tiny_model, graphs=True)
    graphs = runner.decode_graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8]
    replayed = drive(runner, 40)
    assert graphs.num_replays == 3 + 5 + 3 + 2
    assert replayed.tokens == eager.tokens
    for got, expected in zip(replayed.logits, eager.logits, strict=True):
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_padding_writes_only_the_scratch_block(tiny_model, triton_attention):
    """The KV cache has one block past the manager's; padded rows write there and attend to
    nothing, so every block a request owns holds what the eager runner's holds."""
    eager_runner = make_runner(tiny_model, graphs=False)
    runner = make_runner(tiny_model, graphs=True)
    assert runner.kv_caches[0][0].shape[0] == eager_runner.kv_caches[0][0].shape[0] + 1 == 41
    drive(eager_runner, 40)
    drive(runner, 40)
    graphs = runner.decode_graphs
    assert graphs.slot_mapping[3:].eq(40 * BLOCK_SIZE).all() and graphs.seq_lens[3:].eq(0).all()
    for (k, v), (ek, ev) in zip(runner.kv_caches, eager_runner.kv_caches):
        torch.testing.assert_close(k[:40], ek, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(v[:40], ev, atol=2e-5, rtol=1e-4)


def test_the_stand_in_finds_a_buffer_not_updated_in_place(tiny_model, triton_attention, monkeypatch):
    """The harness is not vacuous: a replay that hands the step's block table over by replacing
    the static buffer (the recorded views keep reading the old one) gives other tokens."""
    eager = drive(make_runner(tiny_model, graphs=False), 40)
    runner = make_runner(tiny_model, graphs=True)
    graphs = runner.decode_graphs
    replay = graphs.replay

    def replaces_the_table(input_ids, positions, attn_metadata):
        graphs.block_tables = graphs.block_tables.clone()  # a new tensor: the graphs never see it
        return replay(input_ids, positions, attn_metadata)

    monkeypatch.setattr(graphs, "replay", replaces_the_table)
    replayed = drive(runner, 40)
    assert replayed.tokens != eager.tokens


def test_enforce_eager_runs_no_graphs(tiny_model, triton_attention):
    runner = make_runner(tiny_model, graphs=False)
    assert runner.decode_graphs is None
    assert runner.kv_caches[0][0].shape[0] == 40  # no scratch block either


def test_attention_on_the_host_is_never_captured():
    """The torch path (every device but CUDA's Triton kernel) loops over host lists."""
    cache = (torch.zeros(2, BLOCK_SIZE, 2, 16), torch.zeros(2, BLOCK_SIZE, 2, 16))
    assert not cuda_graphs.attention_captures(cache, torch.float32, torch.device("cpu"))
    # Attention sinks (gpt-oss) take the torch path on CUDA too: decided before any device work.
    assert not cuda_graphs.attention_captures(cache, torch.float32, torch.device("cuda"), sinks=True)


@pytest.mark.skipif(not ON_GPU, reason="a CUDA device decides by itself whether to capture")
def test_on_cuda_no_graphs_without_the_triton_kernel(monkeypatch, tiny_model):
    monkeypatch.setattr(cuda_graphs, "attention_captures", lambda *a: False)
    runner = ModelRunner(tiny_model, num_blocks=8, block_size=BLOCK_SIZE, max_num_batched_tokens=16,
                         max_model_len=32, kv_dtype=torch.float32, device=DEVICE)
    assert runner.decode_graphs is None


def test_steps_past_a_ropes_length_limit_run_eagerly(tiny_models, triton_attention):
    """Dynamic NTK rope (max_position_embeddings 16): its frequencies change past 16 tokens, a
    choice made on the host, so those steps run eagerly; the tokens equal the eager runner's."""
    model = tiny_models["llama_dynamic_rope"]
    eager = drive(make_runner(model, graphs=False), 40)
    runner = make_runner(model, graphs=True)
    replayed = drive(runner, 40)
    assert 0 < runner.decode_graphs.num_replays < 3 + 5 + 3 + 2
    assert replayed.tokens == eager.tokens
    for got, expected in zip(replayed.logits, eager.logits, strict=True):
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


# -- which steps replay ------------------------------------------------------------------------------

def metadata(query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    empty = torch.empty(0)
    return AttentionMetadata(empty, empty, empty, empty, seq_lens_cpu=seq_lens, query_start_loc_cpu=starts)


def test_only_decode_steps_within_the_captured_sizes_replay():
    graphs = DecodeGraphs(torch.nn.Module(), [], max_num_seqs=16, max_blocks_per_seq=4, pad_slot=0,
                          device=torch.device("cpu"), capture=ReplayedForward())
    assert graphs.sizes == [1, 2, 4, 8, 16]
    assert not graphs.can_replay(1, metadata([1], [5]))  # nothing captured yet
    graphs.graphs = dict.fromkeys(graphs.sizes)  # as if captured
    assert graphs.can_replay(3, metadata([1, 1, 1], [5, 9, 2]))
    assert graphs.can_replay(16, metadata([1] * 16, [5] * 16))
    assert not graphs.can_replay(17, metadata([1] * 17, [5] * 17))  # more than the largest
    assert not graphs.can_replay(4, metadata([3, 1], [5, 9]))  # a prefill chunk
    assert not graphs.can_replay(0, metadata([], []))
