"""Tensor parallelism: one model split over several processes (and machines) on torch.distributed.

Rank 0 is the engine core as ever; ranks 1..N-1 are workers that run each step on their share of
the model (docs/distributed.md: the split, the launch, what crosses the network per step).

  sharding  how the model splits over the ranks (ShardPlan), and the checks that it can
  shard     one rank's share as the loader takes it (RankShard)
  layers    the collectives that make the shares compute the whole: row-parallel linear layers,
            the vocabulary-parallel embedding and the gathered LM head
  group     the group's collectives (gloo), timeouts, TensorParallelError
  protocol  what rank 0 and the workers say: the store's keys, each step's header
  driver    rank 0: load_engine_model, start the workers, send them each step
  executor  rank 0's executor: the local one, plus each step's packet and logits rows sent first
  worker    ranks 1..N-1: `python -m pagedllm.distributed.worker`

The engine calls driver.load_engine_model, which is load_model unless tensor_parallel_size > 1;
then it also gives back the driver, which the TensorParallelExecutor sends each step through (the
model carries no driver).
"""
