"""KV memory planning: how many blocks the budget buys, the longest request it holds (max_model_len:
as asked, checked to fit; or, left unset, the model's limit cut down to what the budget holds),
the start-up line that says so, and the KV manager the layout asks for.

No torch: the bytes one block takes (every layer's keys and values) come from the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from pagedllm.config import EngineConfig, parse_size
from pagedllm.core.kv.contiguous import ContiguousKVManager
from pagedllm.core.kv.kinds import FULL_ATTENTION
from pagedllm.core.kv.manager import KVCacheManager, peak_blocks, window_step_cap

# With no budget given: a share of the RAM free at start-up, capped.
DEFAULT_KV_SHARE_OF_FREE_RAM = 0.2
DEFAULT_KV_CAP_BYTES = 4 * 2**30
# On a GPU: this share of the device memory still free once the weights are loaded (the rest is
# for activations, the sampler and other processes).
DEFAULT_KV_SHARE_OF_FREE_GPU = 0.5


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    block_size: int  # tokens
    bytes_per_block: int
    max_model_len: int
    model_max_len: int  # the model's own limit (max_position_embeddings)
    # Keys further back are read by no layer, and the paged manager frees their blocks (None: no
    # window, or a layout that cannot free).
    sliding_window: int | None
    blocks_per_request: int  # the most blocks one max_model_len request holds at once (states too)
    # A hybrid model's: the pages each request's recurrent state takes (model/recurrent_state.py).
    state_pages_per_request: int = 0
    kv_kind: str = FULL_ATTENTION  # what the KV pages hold (core/kv/kinds.py)

    @property
    def fitted(self) -> bool:
        """Whether max_model_len was cut below the model's limit to fit the budget."""
        return self.max_model_len < self.model_max_len

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> int:
        """How many requests max_model_len long the cache holds at once."""
        return self.num_blocks // self.blocks_per_request


def plan_kv_cache(config: EngineConfig, bytes_per_block: int, model_max_len: int,
                  sliding_window: int | None = None,
                  free_device_bytes: int | None = None, state_pages_per_request: int = 0,
                  kv_kind: str = FULL_ATTENTION) -> KVPlan:
    """The blocks config's budget buys and the max_model_len they hold. An explicit
    config.max_model_len that one request cannot fit is refused (ValueError); left unset, it is
    the model's limit, or the longest request the budget holds where that is less (a whole number
    of blocks). sliding_window: the model's (ModelConfig.kv_window); the paged layout frees what
    falls out of it, so a request holds a bounded number of blocks however long it gets: its
    window plus one step's tokens, the step cut to what the budget holds where that is less.
    free_device_bytes: a GPU's free memory (None on the CPU), for the default budget.
    state_pages_per_request: the pages each request's recurrent state takes besides its blocks."""
    budget = _budget_bytes(config, bytes_per_block, free_device_bytes)
    num_blocks, block_size = budget // bytes_per_block, config.block_size
    window = sliding_window if config.kv_layout == "paged" else None

    # On a windowed layout a request holds its window plus one step's tokens; the scheduler keeps
    # each request's step within what the whole cache holds (KVCacheManager.max_step_tokens), so
    # any length the model allows fits, prefilled in shorter chunks where the cache is small.
    step_cap = window_step_cap(max(num_blocks - state_pages_per_request, 1), block_size, window)
    max_chunk = min(config.max_num_batched_tokens, step_cap or config.max_num_batched_tokens)

    num_states = state_pages_per_request

    def blocks_for(num_tokens: int) -> int:
        return peak_blocks(num_tokens, block_size, window, max_chunk) + num_states

    max_model_len = config.max_model_len
    if max_model_len is None:
        if num_blocks < 1 + num_states:
            states = f" beside one request's {num_states} recurrent state pages" if num_states else ""
            raise ValueError(f"kv_cache_memory={budget} bytes holds no KV block{states} ({bytes_per_block} "
                             f"bytes for {block_size} tokens): raise kv_cache_memory")
        fits_model = blocks_for(model_max_len) <= num_blocks
        max_model_len = model_max_len if fits_model else (num_blocks - num_states) * block_size
    blocks_per_request = blocks_for(max_model_len)
    if num_blocks < blocks_per_request:
        raise ValueError(
            f"max_model_len={max_model_len} needs {blocks_per_request} blocks of "
            f"{block_size} tokens ({blocks_per_request * bytes_per_block} bytes), but "
            f"kv_cache_memory={budget} bytes holds only {num_blocks} blocks "
            f"({num_blocks * block_size} tokens): raise kv_cache_memory or lower max_model_len")
    return KVPlan(num_blocks, block_size, bytes_per_block, max_model_len, model_max_len, window,
                  blocks_per_request, num_states, kv_kind)


def _budget_bytes(config: EngineConfig, bytes_per_block: int, free_device_bytes: int | None) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks * bytes_per_block
    if config.kv_cache_memory is not None:
        return parse_size(config.kv_cache_memory)
    if free_device_bytes is not None:
        return int(DEFAULT_KV_SHARE_OF_FREE_GPU * free_device_bytes)
    free = psutil.virtual_memory().available
    return int(min(DEFAULT_KV_CAP_BYTES, DEFAULT_KV_SHARE_OF_FREE_RAM * free))


def make_kv_manager(config: EngineConfig, plan: KVPlan) -> KVCacheManager | ContiguousKVManager:
    """The manager config's kv_layout asks for, over the planned blocks."""
    if config.kv_layout == "contiguous":
        if plan.state_pages_per_request:
            raise ValueError("kv_layout=contiguous does not hold recurrent states (a hybrid model): "
                             "use kv_layout=paged")
        return ContiguousKVManager(plan.num_blocks, plan.block_size, plan.max_model_len,
                                   reserve=config.contiguous_reserve,
                                   bytes_per_block=plan.bytes_per_block)
    return KVCacheManager(plan.num_blocks, plan.block_size,
                          enable_prefix_caching=config.enable_prefix_caching,
                          bytes_per_block=plan.bytes_per_block, sliding_window=plan.sliding_window,
                          state_pages_per_request=plan.state_pages_per_request, kv_kind=plan.kv_kind)


def describe_plan(plan: KVPlan, kv_dtype_name: str, kv_layout: str, draft_bytes_per_block: int = 0) -> str:
    """The start-up log line: what the cache holds, the max_model_len it chose and why, and how
    many requests that long fit at once. draft_bytes_per_block: a draft model's share of each
    block (speculative decoding: its K/V of the block's tokens lives in the block)."""
    per_block = f"{plan.bytes_per_block} bytes per block"
    if draft_bytes_per_block:
        per_block += f" ({draft_bytes_per_block} of them the draft model's K/V)"
    length = f"max_model_len={plan.max_model_len}"
    if plan.fitted:
        length += (f" (the longest request this KV budget holds; the model allows "
                   f"{plan.model_max_len}: raise kv_cache_memory for more)")
    if plan.sliding_window is not None:
        length += (f", its {plan.sliding_window}-token sliding window holding at most "
                   f"{plan.blocks_per_request} blocks of a request,")
    if plan.state_pages_per_request:
        length += (f" (each also holding {plan.state_pages_per_request} pages of recurrent state; "
                   "prefix caching is off for this model: its recurrent layers' state at the end of "
                   "a cached prefix is not kept)")
    return (f"KV cache: {plan.num_blocks} blocks x {plan.block_size} tokens, "
            f"{per_block}, {plan.num_slots} token slots "
            f"({plan.kv_cache_bytes / 2**20:.1f} MiB, KV dtype {kv_dtype_name}, {kv_layout} layout); "
            f"{length} fits {plan.max_concurrency} requests at once")
