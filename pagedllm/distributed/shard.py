"""One rank's share of a model, as the loader takes it: the shape it builds, each weight cut as it
is loaded, and the collectives put in place afterwards (LlamaForCausalLM.from_hf_tensors)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.distributed.layers import parallelize
from pagedllm.distributed.sharding import ShardPlan
from pagedllm.model.config import ModelConfig


@dataclass
class RankShard:
    plan: ShardPlan
    rank: int
    group: TensorParallelGroup

    def rank_config(self) -> ModelConfig:
        return self.plan.rank_config(self.rank)

    def shard_parameter(self, name: str, value):
        return self.plan.shard_parameter(self.rank, name, value)

    def parallelize(self, model: nn.Module) -> None:
        parallelize(model, self.plan, self.rank, self.group)
