"""The CPU weights moved into one huge-page-advised mapping (model/huge_pages.py): every tensor a
module holds follows, ties and views stay what they were, the engine's tokens do not change."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pagedllm.model.huge_pages import huge_pages_available, move_weights_to_huge_pages
from tests.model.test_decode_layers import greedy_with_switch_on_and_off

pytestmark = pytest.mark.skipif(not huge_pages_available(),
                                reason="no transparent huge pages here (not Linux, or set to never)")


@dataclass(frozen=True)
class Packed:
    codes: torch.Tensor
    scales: torch.Tensor


class Holder(torch.nn.Module):
    """Tensors in each place a model keeps them: parameters, a buffer, a view of it in a plain
    attribute, a dataclass in a list, a weight tied to another module's."""

    def __init__(self, tied: torch.nn.Parameter):
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)
        self.register_buffer("table", torch.arange(40, dtype=torch.float32))
        self.window = self.table[10:20]
        codes = torch.randint(0, 255, (16, 8), dtype=torch.uint8)
        self.parts = [Packed(codes, torch.rand(16, dtype=torch.float16))]
        self.tied = tied

    def forward(self, x):
        extra = self.tied[:4, :8].sum() + self.window.sum() + self.parts[0].scales.float().sum()
        return self.linear(x) + extra


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_every_tensor_a_module_holds_moves_with_ties_and_views_kept(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", "1")
    torch.manual_seed(0)
    embed = torch.nn.Embedding(10, 8)
    model = torch.nn.ModuleDict({"embed": embed, "a": Holder(embed.weight), "b": Holder(embed.weight)})
    x = torch.randn(3, 8)
    before = model["a"](x), model["b"](x)
    tensors = [embed.weight] + [t for h in (model["a"], model["b"]) for t in (
        h.linear.weight, h.linear.bias, h.table, h.window, h.parts[0].codes, h.parts[0].scales, h.tied)]
    values = [t.clone() for t in tensors]
    old = {_storage(t) for t in tensors}

    moved = move_weights_to_huge_pages(model)

    assert moved is not None and moved.tensors == len({id(t) for t in tensors})
    assert len({_storage(t) for t in tensors}) == 1 and not old & {_storage(tensors[0])}  # one arena
    for t, v in zip(tensors, values):
        assert torch.equal(t, v)
    assert model["a"].tied is embed.weight and model["b"].tied.data_ptr() == embed.weight.data_ptr()
    holder = model["a"]
    assert holder.window.data_ptr() == holder.table[10:].data_ptr()
    holder.table[10] = -1.0  # the view still sees its base
    assert holder.window[0] == -1.0
    holder.table[10] = 10.0
    after = model["a"](x), model["b"](x)
    assert all(torch.equal(b, a) for b, a in zip(before, after))


def test_the_switch_leaves_the_weights_where_they_are(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", "0")
    model = torch.nn.Linear(4, 4)
    ptr = model.weight.data_ptr()
    assert move_weights_to_huge_pages(model) is None and model.weight.data_ptr() == ptr


def test_weights_too_large_for_the_memory_left_stay(monkeypatch):
    import pagedllm.model.huge_pages as huge_pages

    monkeypatch.setenv("PAGEDLLM_HUGE_PAGES", "1")
    model = torch.nn.Linear(64, 64)  # 16.6 KB of weights
    ptr = model.weight.data_ptr()
    monkeypatch.setattr(huge_pages, "available_memory", lambda: 30_000)
    assert move_weights_to_huge_pages(model) is None and model.weight.data_ptr() == ptr
    monkeypatch.setattr(huge_pages, "available_memory", lambda: 40_000)
    assert move_weights_to_huge_pages(model) is not None and model.weight.data_ptr() != ptr


def test_engine_tokens_are_the_same_with_the_weights_moved(tmp_path, monkeypatch):
    """Through the engine (the runner moves the weights before packing the layers for the one-call
    decode): greedy tokens and logprobs equal with PAGEDLLM_HUGE_PAGES on and off, and with it on
    every weight the model holds lies in one mapping."""
    from pagedllm.model.huge_pages import _tensors_by_storage

    def one_mapping_where_on(model, on):
        assert (len(_tensors_by_storage(model)) == 1) == on

    on, off = greedy_with_switch_on_and_off(tmp_path, monkeypatch, "PAGEDLLM_HUGE_PAGES",
                                            one_mapping_where_on)
    assert on == off
