"""What the engine core steps, loaded and planned before it starts: the loader's and the plan's
half of the core, so that EngineCore itself is only the loop.

In order: the model (whole, or rank 0's shard with its tensor-parallel workers started); on the
CPU the compiled kernels, built or found now rather than inside the first request; the block size
(the device's default where the config leaves it unset: the caller's config is not written to); the
KV cache's plan (how many blocks the byte budget buys at this process's heads per rank, scales
included, so a compressed cache gets proportionally more) and its manager; the scheduler over it;
the runner with its KV cache and the executor that drives it (local, or tensor-parallel: the
workers then build their runners from the same arguments); the sampler and the structured-output
manager. With a draft model (speculative decoding's draft_model), the draft is loaded beside the
target through the same loader, checked against its vocabulary and tokenizer, and its K/V share
the target's blocks (pagedllm.spec_decode.draft): each block's bytes in the plan are both models'.
Last, malloc is tuned for the steps: what loading and prepacking freed goes back to the
OS, and from then on what a step frees is kept for the next one.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from pagedllm.config import EngineConfig, SchedulerConfig, default_block_size
from pagedllm.core.kv.kinds import kv_page_kind
from pagedllm.core.kv.plan import KVPlan, describe_plan, make_kv_manager, plan_kv_cache
from pagedllm.core.scheduler import Scheduler
from pagedllm.distributed.driver import TensorParallelDriver, load_engine_model
from pagedllm.distributed.executor import TensorParallelExecutor
from pagedllm.engine.speculation import Speculator
from pagedllm.kernels import tiers
from pagedllm.kernels.attention import kv_cache_bytes_per_block
from pagedllm.kernels.attention.kv_quant import stored_dtype_name
from pagedllm.lora.request import LoRARequest, parse_lora_modules
from pagedllm.lora.slots import LoRASlots
from pagedllm.model.config import ModelConfig
from pagedllm.model.errors import UnsupportedModelError
from pagedllm.model.loader import LoadedModel, load_model
from pagedllm.model.recurrent_state import pages_per_request
from pagedllm.pooling_params import PoolingSetup
from pagedllm.sampling_bounds import MAX_LOGPROBS
from pagedllm.spec_decode.config import SpeculativeConfig, check_draft_vocabulary
from pagedllm.spec_decode.draft import DraftModelProposer
from pagedllm.structured.compiler import GrammarCompiler
from pagedllm.structured.manager import StructuredOutputManager
from pagedllm.utils import keep_freed_memory_for_reuse, release_freed_memory
from pagedllm.worker.device import resolve_device
from pagedllm.worker.executor import LocalExecutor
from pagedllm.worker.pooler import Pooler
from pagedllm.worker.runner import ModelRunner
from pagedllm.worker.sampler import Sampler

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class CoreFacts:
    """What the core was built with, for the start-up line and the engine's callers."""

    device: torch.device
    dtype: torch.dtype
    kv_plan: KVPlan
    kv_cache_dtype: str  # the stored one's name
    kv_layout: str
    choices: str  # EngineConfig.describe_choices
    weight_bytes: int  # after the runner's prepacking
    vocab_size: int = 0  # the whole vocabulary's (token ids a request names must be below it)
    pooling: PoolingSetup | None = None  # a pooling engine's (EngineConfig.runner); None: it generates
    draft_kv_bytes_per_block: int = 0  # a draft model's share of each KV block's bytes
    max_logprobs: int = MAX_LOGPROBS  # EngineConfig.max_logprobs: the core's check on arrival

    def describe(self, weights_note: str) -> str:
        """The start-up line: every choice that changes which code runs. The KV cache's blocks,
        bytes and what fits; the weights' bytes and weights_note (LoadedModel.weights_note: what
        stayed quantized, what is float); the device and dtype; prefix caching, tensor
        parallelism, batch invariance."""
        plan = describe_plan(self.kv_plan, self.kv_cache_dtype, self.kv_layout, self.draft_kv_bytes_per_block)
        return (f"{plan}; "
                f"weights {self.weight_bytes / 2**20:.1f} MiB ({weights_note}); "
                f"{self.device}, {str(self.dtype).removeprefix('torch.')}, {self.choices}")


@dataclass
class CoreParts:
    scheduler: Scheduler
    executor: LocalExecutor
    sampler: Sampler
    structured: StructuredOutputManager
    grammar_compiler: GrammarCompiler | None  # one process's input processor shares it
    facts: CoreFacts
    lora: LoRASlots | None = None  # with enable_lora
    speculator: Speculator | None = None  # speculative decoding's, where it is on
    decode_burst: int = 1  # EngineConfig.decode_burst (pagedllm.engine.decode_burst)


def load_core_parts(config: EngineConfig) -> tuple[CoreParts, LoadedModel]:
    """The parts over config's model, loaded on config's device; and what the loader read (the
    tokenizer among it, for whoever runs the core in its own process)."""
    device = resolve_device(config.device)
    loaded, driver = load_engine_model(config, device)
    try:
        draft = load_draft_model(config, loaded, device)
        # The dtype the loader resolved and holds the weights in (not resolved a second time).
        parts = build_core_parts(config, loaded.model, loaded.config, loaded.config.dtype,
                                 GrammarCompiler(loaded.tokenizer), driver, draft)
    except BaseException:
        if driver is not None:
            driver.close()
        raise
    return parts, loaded


def load_draft_model(config: EngineConfig, target: LoadedModel, device: torch.device) -> LoadedModel | None:
    """The draft model speculative_config names (None for the other methods), loaded as the
    target was (its dtype, quantization); ValueError (one line) for one that cannot propose to it."""
    spec = SpeculativeConfig.parse(config.speculative_config)
    if spec is None or spec.method != "draft_model":
        return None
    draft = load_model(spec.model, target.config.dtype, device, config.quantization,
                       config.quantization_group_size)
    check_draft_vocabulary(target.config.vocab_size, draft.config.vocab_size, target.tokenizer,
                           draft.tokenizer)
    for name, model_config in (("target", target.config), ("draft", draft.config)):
        if model_config.is_hybrid or model_config.kv_window is not None:
            kind = "recurrent layers" if model_config.is_hybrid else "a sliding window"
            raise ValueError(f"speculative_config: the {name} model has {kind}, which a draft model's "
                             "K/V in the target's blocks does not follow yet; use method 'ngram' or 'suffix'")
    return draft


def build_core_parts(config: EngineConfig, model: torch.nn.Module, model_config: ModelConfig,
                     dtype: torch.dtype, grammar_compiler: GrammarCompiler | None = None,
                     driver: TensorParallelDriver | None = None,
                     draft: LoadedModel | None = None) -> CoreParts:
    """The parts over a loaded model. grammar_compiler: for requests with structured_outputs
    (None: such requests are refused). driver: rank 0's, under tensor parallelism. draft: the draft
    model speculative_config names (load_draft_model)."""
    device = next(model.parameters()).device  # where the loader put the weights
    if device.type == "cpu":
        tiers.available()  # build (or find) the kernels now, not in the first request
    if config.block_size is None:  # the device's default, now that the device is known
        config = dataclasses.replace(config, block_size=default_block_size(device.type))
    if model_config.num_labels and config.runner != "pooling":
        raise UnsupportedModelError(f"{model_config.architecture.removesuffix('ForCausalLM')}"
                                    "ForSequenceClassification is a classifier, with no LM head to "
                                    "generate with: serve it with --runner pooling (or --task score)")
    if config.pooling_reads_every_token and config.enable_prefix_caching:
        logger.info("%s pooling needs every prompt token's hidden state, which a prefix-cache hit "
                    "skips: prefix caching is off", config.pooling_type)
        config = dataclasses.replace(config, enable_prefix_caching=False)
    if model_config.is_hybrid:
        config = _hybrid_config(config)
    # The heads are this process's (model.config): under tensor parallelism its share, the
    # largest of any rank's, so the budget is what each rank's cache may take.
    draft_bytes = 0 if draft is None else _kv_bytes_per_block(
        config, draft.config, dtype, draft.model.config.num_key_value_heads)
    state_shapes = model.state_shapes if model_config.is_hybrid else []
    kv_plan = plan_model_kv_cache(config, model_config, dtype, model.config.num_key_value_heads,
                                  state_shapes, _free_device_bytes(device), draft_bytes)
    scheduler = Scheduler(
        SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, kv_plan.max_model_len,
                        config.scheduling_policy, config.step_share_tokens),
        make_kv_manager(config, kv_plan))
    executor = _make_executor(config, model, kv_plan, dtype, device, driver)
    facts = CoreFacts(device, dtype, kv_plan, stored_dtype_name(config.kv_cache_dtype, dtype),
                      config.kv_layout, config.describe_choices(dtype), model.weight_bytes(),
                      model_config.vocab_size,
                      PoolingSetup.of(config, model_config.hidden_size, model_config.num_labels),
                      draft_bytes, config.max_logprobs)
    release_freed_memory()  # what loading and prepacking the weights freed
    keep_freed_memory_for_reuse()  # from here on, what a step frees serves the next
    lora = _lora_slots(config, executor, model_config) if config.enable_lora else None
    sampler = Sampler(config.seed, device)
    spec_config = SpeculativeConfig.parse(config.speculative_config)
    speculator = None
    if spec_config is not None:
        proposer = None if draft is None else _draft_proposer(config, draft, kv_plan, dtype, device, sampler)
        if spec_config.method == "draft_model" and proposer is None:
            raise ValueError("speculative_config: method 'draft_model' needs its model loaded "
                             "(load_draft_model)")
        speculator = Speculator(spec_config, sampler, kv_plan.max_model_len, proposer)
    return CoreParts(scheduler, executor, sampler, StructuredOutputManager(grammar_compiler),
                     grammar_compiler, facts, lora, speculator, config.decode_burst)


def plan_model_kv_cache(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                        kv_heads: int, state_shapes: list[tuple[int, ...]],
                        free_device_bytes: int | None = None, draft_bytes_per_block: int = 0) -> KVPlan:
    """The KV plan for a model of this shape (config.block_size set): its attention layers' bytes
    per block (a latent-attention model's one latent per token, keys and values at once) and a
    draft model's share of each block, the pages of one request's recurrent state (state_shapes;
    [] where it has none), what the budget buys. kv_heads: this process's share of the KV heads."""
    latent = model_config.kv_lora_rank > 0
    bytes_per_block = _kv_bytes_per_block(config, model_config, dtype, kv_heads) + draft_bytes_per_block
    return plan_kv_cache(config, bytes_per_block, model_config.max_position_embeddings,
                         sliding_window=model_config.kv_window, free_device_bytes=free_device_bytes,
                         state_pages_per_request=pages_per_request(state_shapes, bytes_per_block),
                         kv_kind=kv_page_kind(model_config.kv_window, latent))


def _kv_bytes_per_block(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                        kv_heads: int) -> int:
    """What one block of a model's K/V takes (every attention layer's keys and values, scales
    included), at this process's heads per rank (kv_heads)."""
    return kv_cache_bytes_per_block(
        len(model_config.attention_layers), config.block_size, kv_heads, model_config.head_dim, dtype,
        config.kv_cache_dtype, values_share_keys=model_config.kv_lora_rank > 0)


def _draft_proposer(config: EngineConfig, draft: LoadedModel, kv_plan: KVPlan, dtype: torch.dtype,
                    device: torch.device, sampler: Sampler) -> DraftModelProposer:
    """The draft's runner, its KV tensors indexed by the target's block ids (as many blocks),
    and the proposer over it. Eager: its passes are few and small, and a graph's scratch block
    would sit past the shared ids."""
    runner = ModelRunner(draft.model, num_blocks=kv_plan.num_blocks, block_size=config.block_size,
                         max_num_batched_tokens=config.max_num_batched_tokens,
                         max_model_len=kv_plan.max_model_len, kv_dtype=dtype, device=device,
                         kv_cache_dtype=config.kv_cache_dtype, enforce_eager=True,
                         max_num_seqs=config.max_num_seqs)
    return DraftModelProposer(runner, sampler, config.max_num_batched_tokens)


def _hybrid_config(config: EngineConfig) -> EngineConfig:
    """What a hybrid model runs with: its recurrent states live in pages of the model's dtype, cannot
    be rolled back (no speculative decoding), and have no checkpoints at block ends (so no prefix
    caching: the start-up line says so)."""
    if config.kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype} is not supported for hybrid models "
                         "(their recurrent states share the KV pages): use auto")
    if config.speculative_config:
        raise ValueError("speculative decoding is not supported for hybrid models (a recurrent state "
                         "cannot be rolled back past rejected tokens)")
    return dataclasses.replace(config, enable_prefix_caching=False)


def _make_executor(config: EngineConfig, model: torch.nn.Module, kv_plan: KVPlan, dtype: torch.dtype,
                   device: torch.device, driver: TensorParallelDriver | None) -> LocalExecutor:
    """The runner with its KV cache, and the executor over it (the workers' runners, under tensor
    parallelism, are built from the same KV arguments)."""
    kv_args = dict(num_blocks=kv_plan.num_blocks, block_size=config.block_size,
                   max_num_batched_tokens=config.max_num_batched_tokens,
                   max_model_len=kv_plan.max_model_len, kv_cache_dtype=config.kv_cache_dtype)
    runner = ModelRunner(model, kv_dtype=dtype, device=device, batch_invariant=config.batch_invariant,
                         enforce_eager=config.enforce_eager, max_num_seqs=config.max_num_seqs,
                         mirrored=driver is not None,
                         lora=(config.max_loras, config.max_lora_rank) if config.enable_lora else None,
                         **kv_args)
    pooler = Pooler(config.pooling_type) if config.runner == "pooling" else None
    if driver is None:
        return LocalExecutor(runner, pooler)
    return TensorParallelExecutor(runner, driver,
                                  dict(kv_args, kv_dtype=str(dtype).removeprefix("torch.")), pooler)


def _lora_slots(config: EngineConfig, executor: LocalExecutor, model_config: ModelConfig) -> LoRASlots:
    """The core's LoRA slots, --lora-modules' adapters read and checked now (ids 1, 2, ... in
    their order, as the server numbers them): a bad one stops the start in one line naming it."""
    lora = LoRASlots(executor.runner.lora_manager, model_config, config.max_cpu_loras or config.max_loras)
    for lora_id, (name, path) in enumerate(parse_lora_modules(config.lora_modules).items(), 1):
        lora.read(LoRARequest(name, lora_id, path))
    return lora


def _free_device_bytes(device: torch.device) -> int | None:
    """Memory still free on a GPU once the weights are loaded (None on the CPU)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free
