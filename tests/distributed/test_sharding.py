"""The split itself, in one process: every rank's shard of a tiny model of each architecture, run
in a thread of its own with the collectives done between threads, gives rank 0 the whole model's
logits (float32); the shares are as even as they can be; what cannot split is refused with the
numbers; quantized weights split on their group boundaries."""

from __future__ import annotations

import threading

import pytest
import torch

from pagedllm.distributed.shard import RankShard
from pagedllm.distributed.sharding import ShardPlan, split
from pagedllm.model.errors import UnsupportedModelError
from pagedllm.model.loader import load_model
from pagedllm.model.quant_weight import quantize
from tests.model.paged import PagedSequences
from tests.model.tiny import SHAPES


class ThreadGroup:
    """The collectives of TensorParallelGroup between threads of one process (sums in rank order;
    a rank whose thread failed leaves the others to time out at the barrier)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=60)
        self._slots: list[torch.Tensor | None] = [None] * size

    def rank(self, rank: int) -> _RankView:
        return _RankView(self, rank)

    def exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._slots[rank] = tensor.clone()
        self._barrier.wait()
        parts = list(self._slots)
        self._barrier.wait()
        return parts


class _RankView:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size

    def all_reduce(self, tensor: torch.Tensor) -> None:
        parts = self.group.exchange(self.rank, tensor)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        tensor.copy_(total)

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's parts, on every rank (the real group gives them to rank 0 only; here each
        thread's step goes on with whole logits)."""
        return self.group.exchange(self.rank, tensor)


def run_ranks(models: list, prompts: list[list[int]]) -> torch.Tensor:
    """Rank 0's logits of a prefill step of prompts and one decode step, every rank in a thread."""
    results: dict[int, list] = {}

    def run(rank: int) -> None:
        paged = PagedSequences(models[rank], num_blocks=32, block_size=4)
        first = paged.step(dict(enumerate(prompts)))
        second = paged.step({i: [7] for i in range(len(prompts))})
        results[rank] = [first, second]

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(models))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    steps = results[0]
    return torch.cat([logits for step in steps for logits in step.values()])


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [40, 41, 42]]


# Latent attention is refused under tensor parallelism (test_tensor_parallel.py checks the line).
# MLA and hybrid models refuse tensor parallelism (tests/model/test_mla.py, test_hybrid.py say so).
@pytest.mark.parametrize("shape", sorted(s for s in SHAPES if not s.endswith(("_mla", "_hybrid"))))
@pytest.mark.parametrize("size", [2, 4])
def test_shards_compute_the_whole_models_logits(tiny_checkpoint, shape, size):
    folder = tiny_checkpoint(shape).folder
    whole = load_model(folder, dtype="float32").model
    plan = ShardPlan(whole.config, size)
    group = ThreadGroup(size)
    models = [load_model(folder, dtype="float32", shard=RankShard(plan, r, group.rank(r))).model
              for r in range(size)]
    paged = PagedSequences(whole, num_blocks=32, block_size=4)
    expected = torch.cat([*paged.step(dict(enumerate(PROMPTS))).values(),
                          *paged.step({i: [7] for i in range(len(PROMPTS))}).values()])
    torch.testing.assert_close(run_ranks(models, PROMPTS), expected, atol=2e-5, rtol=2e-5)


def test_mxfp4_experts_split_over_ranks(tmp_path):
    """gpt-oss's MXFP4 experts, kept quantized, cut at group boundaries (each rank 32 of an
    expert's 64 columns): the whole model's logits."""
    from tests.model.test_moe import mxfp4_round_trip, save_mxfp4_folder
    from tests.model.tiny import make_hf_model

    hf_model = make_hf_model("gpt_oss", intermediate_size=64)
    mxfp4_round_trip(hf_model)
    folder = save_mxfp4_folder(hf_model, tmp_path / "mxfp4")
    whole = load_model(folder, dtype="float32").model
    plan, group = ShardPlan(whole.config, 2), ThreadGroup(2)
    models = [load_model(folder, dtype="float32", shard=RankShard(plan, r, group.rank(r))).model
              for r in range(2)]
    assert models[1].layers[0].mlp.inner.experts[0].down_proj.parts[0].source == "MXFP4"
    paged = PagedSequences(whole, num_blocks=32, block_size=4)
    expected = torch.cat([*paged.step(dict(enumerate(PROMPTS))).values(),
                          *paged.step({i: [7] for i in range(len(PROMPTS))}).values()])
    torch.testing.assert_close(run_ranks(models, PROMPTS), expected, atol=2e-5, rtol=2e-5)


def test_a_hybrid_models_shard_is_refused(tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_5_hybrid").folder
    config = load_model(folder, dtype="float32").config
    plan, group = ShardPlan(config, 2), ThreadGroup(2)
    with pytest.raises(UnsupportedModelError, match="tensor parallelism is not supported for hybrid"):
        load_model(folder, dtype="float32", shard=RankShard(plan, 0, group.rank(0)))


def test_split_is_as_even_as_it_can_be_larger_first():
    assert split(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split(96, 2, unit=32) == [(0, 64), (64, 96)]
    assert split(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_plan_shares(tiny_checkpoint):
    config = load_model(tiny_checkpoint("llama_gqa_untied").folder, dtype="float32").config
    # 4 heads in 2 KV groups, intermediate 96, vocabulary 300.
    two = ShardPlan(config, 2)
    assert [s.q_heads for s in two.shares] == [(0, 2), (2, 4)]
    assert [s.kv_heads for s in two.shares] == [(0, 1), (1, 2)]
    assert two.describe() == ("2 attention heads, 1 KV heads, 64/32 MLP columns, "
                              "150 vocabulary rows per rank")
    four = ShardPlan(config, 4)  # each KV head on two ranks, one query head each
    assert [s.kv_heads for s in four.shares] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [s.q_heads for s in four.shares] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    rank3 = four.rank_config(3)
    assert (rank3.num_attention_heads, rank3.num_key_value_heads, rank3.vocab_size) == (1, 1, 75)


@pytest.mark.parametrize("size, message", [
    (3, "tensor_parallel_size=3: the model's 2 KV heads can neither be split over 3 ranks"),
    (8, "each of the model's 2 KV heads would be replicated on 4 ranks, but has only 2 query heads"),
])
def test_plan_refuses_what_cannot_split(tiny_checkpoint, size, message):
    config = load_model(tiny_checkpoint("llama_gqa_untied").folder, dtype="float32").config
    with pytest.raises(ValueError, match=message):
        ShardPlan(config, size)


@pytest.mark.parametrize("bits, group_size", [(8, 16), (8, 32), (4, 32), (4, 16)])
def test_quantized_columns_split_on_group_boundaries(bits, group_size):
    weight = quantize(torch.randn(8, 128), bits, group_size)
    unit = group_size if bits == 8 else 32
    part = weight.columns(unit, 3 * unit)
    assert torch.equal(part.dequantize(), weight.dequantize()[:, unit:3 * unit])
    with pytest.raises(ValueError, match=f"input {unit // 2} is inside a group"):
        weight.columns(unit // 2, 3 * unit)
