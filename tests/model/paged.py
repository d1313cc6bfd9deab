"""A minimal stand-in for the engine's runner, for model tests: sequences get physical blocks in
shuffled order as they grow, and each step runs one flat batch through the paged cache."""

from __future__ import annotations

import random

import torch

from pagedllm.kernels.attention import allocate_kv_cache
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.utils import cdiv
from tests.conftest import build_attn_metadata


class PagedSequences:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, seed: int = 0,
                 kv_cache_dtype: str = "auto"):
        config = model.config
        self.model = model
        self.block_size = block_size
        self.device = model.norm.weight.device  # the cache and each step's inputs go there
        self.kv_caches = allocate_kv_cache(
            config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads,
            config.head_dim, config.dtype, self.device, kv_cache_dtype=kv_cache_dtype)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)  # physical order unrelated to logical
        self.blocks: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}

    @torch.inference_mode()
    def step(self, new_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Compute new_tokens[seq] for every seq in one batch; logits [num_new, vocab] each."""
        requests, input_ids = [], []
        for seq, tokens in new_tokens.items():
            computed = self.num_computed.setdefault(seq, 0)
            blocks = self.blocks.setdefault(seq, [])
            while len(blocks) * self.block_size < computed + len(tokens):
                blocks.append(self.free_blocks.pop())
            requests.append((computed, len(tokens), blocks))
            input_ids += tokens
        metadata, positions = build_attn_metadata(requests, self.block_size)
        for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
            setattr(metadata, name, getattr(metadata, name).to(self.device))
        hidden = self.model(torch.tensor(input_ids, device=self.device), positions.to(self.device),
                            self.kv_caches, metadata)
        logits = self.model.compute_logits(hidden)
        out, start = {}, 0
        for seq, tokens in new_tokens.items():
            out[seq] = logits[start:start + len(tokens)]
            start += len(tokens)
            self.num_computed[seq] += len(tokens)
        return out


def greedy_generate(
    model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int, block_size: int = 4
) -> list[list[int]]:
    """Greedy continuations of all prompts, batched: one prefill step, then batched decodes."""
    longest = max(len(p) for p in prompts) + max_new_tokens
    blocks_per_seq = cdiv(longest, block_size)
    paged = PagedSequences(model, blocks_per_seq * len(prompts), block_size)
    logits = paged.step(dict(enumerate(prompts)))
    outputs = [[int(logits[i][-1].argmax())] for i in range(len(prompts))]
    for _ in range(max_new_tokens - 1):
        logits = paged.step({i: out[-1:] for i, out in enumerate(outputs)})
        for i, out in enumerate(outputs):
            out.append(int(logits[i][-1].argmax()))
    return outputs
