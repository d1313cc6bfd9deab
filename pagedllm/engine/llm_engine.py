"""LLMEngine: the three parts of the engine in one process, stepped by the caller.

  input processor  (pagedllm.engine.input_processor)   prompt checks, tokenization, chat templates
  engine core      (pagedllm.engine.core)       scheduler, KV manager, executor (runner), sampler
  output processor (pagedllm.engine.output_processor)  detokenization, stop strings, RequestOutputs

A request goes in through the input processor as an EngineCoreRequest; each step() runs one
core step and turns its new token ids into RequestOutputs; a stop string the output processor
finds is handed back to the core as an abort. The offline LLM drives this class; the server uses
the same three parts with the core in a process of its own (pagedllm/engine/core_process.py, fed by
pagedllm/server/async_engine.py over pagedllm/engine/core_channel.py).
"""

from __future__ import annotations

import logging
import time

from pagedllm.config import EngineConfig
from pagedllm.core.kv.plan import KVPlan
from pagedllm.core.kv.snapshot import BlockMap
from pagedllm.engine.core import EngineCore, StepError
from pagedllm.engine.input_processor import InputProcessor, PromptInput
from pagedllm.engine.messages import EngineCoreStats
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.text.generation_defaults import read_generation_defaults

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        if config is not None and kwargs:
            raise TypeError(f"LLMEngine takes an EngineConfig or its fields as keywords, not both "
                            f"(got {', '.join(kwargs)} beside the config)")
        self.config = config or EngineConfig(**kwargs)
        started = time.monotonic()
        self.engine_core, loaded = EngineCore.load(self.config)
        self.device = self.engine_core.device
        self.dtype = self.engine_core.dtype
        self.weights_note = loaded.weights_note  # what stayed quantized, what is float
        self.weight_bytes = self.engine_core.facts.weight_bytes
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_path = loaded.path
        # One compiler for the input processor and the core: what one compiled, the other finds.
        self.grammar_compiler = self.engine_core.grammar_compiler
        plan = self.engine_core.kv_plan
        self.input_processor = InputProcessor(
            self.tokenizer, loaded.config.vocab_size, plan.max_model_len,
            sampling_defaults=read_generation_defaults(self.config.generation_config, loaded.path),
            grammar_compiler=self.grammar_compiler, pooling=self.engine_core.facts.pooling,
            scheduling_policy=self.config.scheduling_policy, max_logprobs=self.config.max_logprobs)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.startup_s = time.monotonic() - started
        logger.info("%s; start-up %.2fs", self.engine_core.facts.describe(self.weights_note), self.startup_s)

    @property
    def kv_plan(self) -> KVPlan:
        """What the KV cache was planned with: blocks, block size, bytes, max_model_len."""
        return self.engine_core.kv_plan

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptInput,
                    sampling_params: SamplingParams | None = None, *,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None, priority: int = 0) -> None:
        """Queue a request (sampling_params None: the model's defaults, as
        InputProcessor.default_sampling_params). lora_request: the LoRA adapter it runs with
        (enable_lora); priority: lower first (scheduling_policy="priority"). Bad input raises
        ValueError and leaves nothing behind."""
        if request_id in self.output_processor:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, request = self.input_processor.process(request_id, prompt, sampling_params,
                                                     arrival_time=arrival_time, cache_salt=cache_salt,
                                                     lora_request=lora_request, priority=priority)
        self.engine_core.add_request(request)  # raises if it can never fit the cache
        self.output_processor.add_request(request, text)

    def add_pooling_request(self, request_id: str, prompt: PromptInput, pooling: PoolingParams, *,
                            arrival_time: float | None = None, cache_salt: str | None = None) -> None:
        """Queue a pooling request (a --runner pooling engine's; params from
        input_processor.pooling_params): its one output is a PoolingRequestOutput."""
        if request_id in self.output_processor:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, request = self.input_processor.process_pooling(request_id, prompt, pooling,
                                                             arrival_time=arrival_time, cache_salt=cache_salt)
        self.engine_core.add_request(request)
        self.output_processor.add_request(request, text)

    def abort_request(self, request_id: str) -> bool:
        """Abort a request (all its n sequences) in any state; frees its blocks at once."""
        self.engine_core.abort_requests([request_id])
        return self.output_processor.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    @property
    def num_unfinished_requests(self) -> int:
        return self.output_processor.num_unfinished_requests

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """One batch. The RequestOutputs due now, each in its request's output_kind. If the model
        step fails, its requests are aborted and engine_core.StepError says which."""
        try:
            core_outputs = self.engine_core.step()
        except StepError as exc:
            for request_id in exc.request_ids:
                self.output_processor.abort_request(request_id)
            raise
        if core_outputs.failed:  # offline, a request that fails the model fails the call
            for request_id in core_outputs.failed:
                self.output_processor.abort_request(request_id)
            raise StepError(core_outputs.failed, RuntimeError(core_outputs.failure))
        processed = self.output_processor.process_outputs(core_outputs.outputs)
        if processed.sequences_to_abort:
            self.engine_core.abort_sequences(processed.sequences_to_abort)
        return processed.request_outputs

    # -- figures ------------------------------------------------------------------------------
    def stats(self) -> EngineCoreStats:
        return self.engine_core.stats()

    def block_map(self) -> BlockMap:
        return self.engine_core.block_map()

    def memory_stats(self) -> dict:
        """The core's figures as one flat dict (blocks, slots, waste, preemptions, counters), and
        the bytes the model's weights take."""
        return {**self.stats().to_dict(), "weight_bytes": self.weight_bytes}
