"""How a Llama-family model is split over tensor-parallel ranks (Megatron's split), and the
checks that it can be.

Each rank holds a share of every layer:
- attention heads: whole groups of query heads with their KV head (GQA), so each rank's attention
  is an ordinary attention over its own heads and its KV cache holds only its KV heads. With
  fewer KV heads than ranks, each KV head is replicated on ranks / num_kv_heads ranks that split
  its query heads between them;
- the fused q/k/v and gate/up projections by output rows (column-parallel: no communication),
  o_proj and down_proj by input columns (row-parallel: each rank's partial product, then one
  all-reduce; their bias added once, after it);
- the embedding and the LM head by vocabulary rows: a token's embedding row lives on one rank
  (the others give zeros, an all-reduce sums them), and each rank's logits cover its rows, gathered
  on rank 0, which samples.
Norms (and per-head q/k norms) are whole on every rank.
- a mixture-of-experts layer (model/moe.py) like its MLP: every expert's intermediate columns cut
  the same way (gate/up rows, down columns), the router whole on every rank so each rank routes
  each token alike; a shared expert's columns cut as well (its gate, Qwen2-MoE's, whole: each
  rank scales its partial output by the same factor); the layer's partial output summed by one
  all-reduce.

Shares that do not divide evenly are as even as they can be, the larger first (rank 0 holds the
largest, so its KV cache is the largest any rank needs). The MLP's columns split at multiples of
32 (or 16) where the size allows, so that quantized weights split on their group boundaries; a quantized
weight that still cannot be split (QuantizedWeight.columns) fails the load with its reason.

The architectures in model/architectures.py all share this plan: their departures from Llama
(biases, norms, soft-caps, windows) touch none of the split dimensions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pagedllm.model.config import ModelConfig
from pagedllm.model.quant_weight import QuantizedWeight

Span = tuple[int, int]  # [start, end)

# The MLP's input columns split at multiples of the first of these the size allows (quantization
# groups are 16 or 32 inputs, and 4-bit codes are packed in runs of 32).
MLP_SPLIT_UNITS = (32, 16, 1)


def split(total: int, parts: int, unit: int = 1) -> list[Span]:
    """total split into `parts` consecutive spans, multiples of unit, as even as possible, the
    larger first."""
    base, extra = divmod(total // unit, parts)
    bounds = [0]
    for rank in range(parts):
        bounds.append(bounds[-1] + (base + (rank < extra)) * unit)
    return [(bounds[r], bounds[r + 1]) for r in range(parts)]


@dataclass(frozen=True)
class RankShare:
    """What one rank holds, as spans of the whole model's heads, MLP columns and vocabulary."""

    q_heads: Span
    kv_heads: Span
    intermediate: Span
    vocab: Span
    moe_intermediate: Span = (0, 0)  # each expert's columns, on a mixture-of-experts model
    shared_intermediate: Span = (0, 0)  # the shared expert's columns, where it has one


class ShardPlan:
    """The split of one model over `size` ranks; ValueError, naming the numbers, where it cannot."""

    def __init__(self, config: ModelConfig, size: int) -> None:
        self.config = config
        self.size = size
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        intermediate, vocab = config.intermediate_size, config.vocab_size
        what = f"tensor_parallel_size={size}"
        if config.kv_lora_rank and size > 1:
            raise ValueError(f"{what}: latent attention ({config.architecture}) is not split over "
                             "ranks yet; use tensor_parallel_size=1")
        if kv_heads >= size:
            kv_spans = split(kv_heads, size)
            group = heads // kv_heads
            q_spans = [(start * group, end * group) for start, end in kv_spans]
        elif size % kv_heads:
            raise ValueError(f"{what}: the model's {kv_heads} KV heads can neither be split over "
                             f"{size} ranks nor replicated evenly on them (use a size that "
                             f"divides {kv_heads} or a multiple of it)")
        else:
            replicas, group = size // kv_heads, heads // kv_heads
            if group < replicas:
                raise ValueError(f"{what}: each of the model's {kv_heads} KV heads would be "
                                 f"replicated on {replicas} ranks, but has only {group} query "
                                 f"heads to split between them")
            kv_spans = [(r // replicas, r // replicas + 1) for r in range(size)]
            q_spans = [(kv * group + start, kv * group + end) for kv, _ in kv_spans[::replicas]
                       for start, end in split(group, replicas)]
        if intermediate < size:
            raise ValueError(f"{what}: the model's intermediate size {intermediate} is too small "
                             f"to split over {size} ranks")
        unit = next(u for u in MLP_SPLIT_UNITS if intermediate % u == 0 and intermediate // u >= size)
        if vocab < size:
            raise ValueError(f"{what}: the model's vocabulary of {vocab} is too small to split")
        moe_spans = shared_spans = [(0, 0)] * size
        if config.num_experts:
            moe_spans = _mlp_split(config.moe_intermediate_size, size, f"{what}: the experts'")
        if config.shared_expert_intermediate_size:
            shared_spans = _mlp_split(config.shared_expert_intermediate_size, size,
                                      f"{what}: the shared expert's")
        self.shares = [RankShare(*spans) for spans in zip(
            q_spans, kv_spans, split(intermediate, size, unit), split(vocab, size), moe_spans, shared_spans)]

    def describe(self) -> str:
        """The split in one line, for the start-up log."""
        def sizes(spans: list[Span]) -> str:
            values = [end - start for start, end in spans]
            return str(values[0]) if len(set(values)) == 1 else "/".join(map(str, values))
        shares = self.shares
        return (f"{sizes([s.q_heads for s in shares])} attention heads, "
                f"{sizes([s.kv_heads for s in shares])} KV heads, "
                f"{sizes([s.intermediate for s in shares])} MLP columns, "
                f"{sizes([s.vocab for s in shares])} vocabulary rows per rank")

    def rank_config(self, rank: int) -> ModelConfig:
        """The shape of rank's share: what its modules hold and its KV cache stores."""
        share = self.shares[rank]
        return dataclasses.replace(
            self.config, num_attention_heads=_length(share.q_heads),
            num_key_value_heads=_length(share.kv_heads),
            intermediate_size=_length(share.intermediate), vocab_size=_length(share.vocab),
            moe_intermediate_size=_length(share.moe_intermediate),
            shared_expert_intermediate_size=_length(share.shared_intermediate))

    def shard_parameter(self, rank: int, name: str, value):
        """Rank's part of one of the model's parameters (our names, fused as LlamaForCausalLM
        holds them): a float tensor or the list of a quantized weight's parts."""
        share, config = self.shares[rank], self.config
        head_dim = config.head_dim
        if name.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias")):
            q_rows = config.num_attention_heads * head_dim
            kv_rows = config.num_key_value_heads * head_dim
            q, kv = _scaled(share.q_heads, head_dim), _scaled(share.kv_heads, head_dim)
            return _take_rows(value, [q, _shifted(kv, q_rows), _shifted(kv, q_rows + kv_rows)])
        if name.endswith(("mlp.gate_up_proj.weight", "mlp.gate_up_proj.bias")):
            columns = share.intermediate
            return _take_rows(value, [columns, _shifted(columns, config.intermediate_size)])
        if name.endswith("self_attn.sinks"):  # gpt-oss: one logit per query head
            return value[share.q_heads[0]:share.q_heads[1]].clone()
        if ".mlp.experts." in name:  # one expert of a mixture: its own columns, as an MLP's
            columns, width = share.moe_intermediate, config.moe_intermediate_size
            if name.endswith(("gate_up_proj.weight", "gate_up_proj.bias")):
                return _take_rows(value, [columns, _shifted(columns, width)])
            if name.endswith("down_proj.bias"):
                # The ranks' outputs are summed (layers.ReducedOutput): the bias counts on one.
                return value if rank == 0 else torch.zeros_like(value)
            return self._take_columns(name, value, [s.moe_intermediate for s in self.shares], rank)
        if ".mlp.shared_experts." in name:  # the shared expert: its own columns, as an MLP's
            columns, width = share.shared_intermediate, config.shared_expert_intermediate_size
            if name.endswith("gate_up_proj.weight"):
                return _take_rows(value, [columns, _shifted(columns, width)])
            return self._take_columns(name, value, [s.shared_intermediate for s in self.shares], rank)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return _take_rows(value, [share.vocab])
        if name.endswith("self_attn.o_proj.weight"):
            return self._take_columns(name, value, [_scaled(s.q_heads, head_dim) for s in self.shares],
                                      rank)
        if name.endswith("mlp.down_proj.weight"):
            return self._take_columns(name, value, [s.intermediate for s in self.shares], rank)
        return value  # whole on every rank: norms, routers and gates, the row-parallel layers' biases

    def _take_columns(self, name: str, value, spans: list[Span], rank: int):
        """Rank's input columns of a row-parallel weight. A quantized one is checked at every
        rank's boundaries, so that rank 0 fails the load for any rank that cannot take its part."""
        start, end = spans[rank]
        if isinstance(value, torch.Tensor):
            return value[:, start:end].clone(memory_format=torch.contiguous_format)
        (part,) = value  # o_proj and down_proj are single weights
        for boundary in sorted({b for span in spans for b in span}):
            why = part.column_split_error(boundary)
            if why:
                raise ValueError(
                    f"tensor_parallel_size={self.size}: {name} ({part.source}, "
                    f"{part.shape[1]} inputs) cannot be split at input {boundary}: {why}; "
                    f"load it dequantized (quantization='none') or use another size")
        return [part.columns(start, end)]


def _mlp_split(width: int, size: int, what: str) -> list[Span]:
    """An MLP's intermediate columns over size ranks, at quantization-group multiples where it can."""
    if width < size:
        raise ValueError(f"{what} intermediate size {width} is too small to split over {size} ranks")
    unit = next(u for u in MLP_SPLIT_UNITS if width % u == 0 and width // u >= size)
    return split(width, size, unit)


def _length(span: Span) -> int:
    return span[1] - span[0]


def _scaled(span: Span, factor: int) -> Span:
    return span[0] * factor, span[1] * factor


def _shifted(span: Span, offset: int) -> Span:
    return span[0] + offset, span[1] + offset


def _take_rows(value, spans: list[Span]):
    """The rows of spans (of the fused weight), copied: a float tensor, or a quantized weight's
    parts cut where the spans and the parts meet (QuantLinear stacks the pieces back)."""
    if isinstance(value, torch.Tensor):
        return torch.cat([value[start:end] for start, end in spans])
    pieces: list[QuantizedWeight] = []
    for start, end in spans:
        offset = 0
        for part in value:
            rows = part.shape[0]
            lo, hi = max(start, offset), min(end, offset + rows)
            if lo < hi:
                pieces.append(part.select_rows(torch.arange(lo - offset, hi - offset)))
            offset += rows
    return pieces
