"""What goes into the engine core and what comes out of it: plain data only.

The core (pagedllm.engine.core) takes EngineCoreRequests and answers each step with
EngineCoreOutputs: for every sequence with news, its NEW token ids (never the whole list), their
log-probabilities as plain numbers and, once it ends, why; plus the core's figures. Ids, numbers,
short strings and the SamplingParams dataclass: the same objects serve a core in this process
(the offline LLM) and one in another process (the server), where pagedllm.engine.core_channel carries
them as msgspec Structs encoded with msgpack (never pickle). No torch here.

A field added to EngineCoreRequest (a grammar spec, say) needs a default and a type msgspec
can encode (a Struct, a dataclass, or plain containers of them): then it crosses the channel
with nothing else to change.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import msgspec

from pagedllm.core.kv.stats import KVStats
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import TokenLogprobs
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.metrics import SpecDecodeStats


class EngineCoreRequest(msgspec.Struct):
    """A checked, tokenized request, as pagedllm.engine.input_processor hands it to the core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Every id that ends a generation (Tokenizer.eos_token_ids: the tokenizer's EOS, the model's
    # and generation config's eos ids, GGUF end-of-turn ids); the first is the tokenizer's EOS.
    eos_token_ids: tuple[int, ...]
    arrival_time: float
    cache_salt: str | None = None
    # SamplingParams.bad_words as token sequences (the input processor tokenizes them).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # A pooling request's (an engine with --runner pooling takes only these): its vector comes
    # back in place of tokens.
    pooling: PoolingParams | None = None
    lora: LoRARequest | None = None  # the LoRA adapter it runs with (None: the base model)
    priority: int = 0  # lower first, under --scheduling-policy priority (pagedllm.core.priority)


# Per-step outputs are many small objects: array_like encodes them as arrays (no field names on
# the wire) and gc=False keeps them out of the garbage collector (they hold no cycles).
class EngineCoreOutput(msgspec.Struct, array_like=True, gc=False):
    """What one step did for one sequence (output `index` of request `request_id`)."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, if asked for
    finish_reason: str | None = None  # "stop", "length" or "abort" once the sequence ended
    stop_reason: int | None = None  # the stop token id that ended it, if one did
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served
    first_scheduled_time: float | None = None  # time.monotonic() when the request first ran
    num_preemptions: int = 0  # times this sequence was preempted; set once it finished
    # SamplingParams.prompt_logprobs: one entry per prompt token (the first None), sent once,
    # with sequence 0's first token.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # A pooling request's vector (PoolingParams), with its finish; it has no tokens.
    pooled: list[float] | None = None


@dataclass(frozen=True)
class EngineCoreStats:
    """The core's figures after a step (or now, between steps)."""

    kv: KVStats
    num_running: int
    num_waiting: int
    num_preemptions: int  # since start, like the counters below
    num_prompt_tokens: int  # of every request added
    num_generation_tokens: int  # tokens sampled (or chosen), every sequence counted
    num_computed_tokens: int  # tokens run through the model: prefill chunks and decodes
    kv_cache_dtype: str  # what the KV cache stores: the model's dtype, or int8 / fp8_e4m3 / fp8_e5m2
    step_num_requests: int = 0  # requests the last step ran
    step_num_used_blocks: int = 0  # blocks in use while it ran (before finished ones went back)
    spec_decode: SpecDecodeStats | None = None  # speculative decoding's counters, where it is on
    # The token share's free tokens now (pagedllm.core.step_cost): measured or set; None unmeasured.
    step_share_tokens: int | None = None
    # A draft model's share of kv.bytes_per_block: its K/V of a block's tokens lives in the block.
    draft_kv_bytes_per_block: int = 0

    def to_dict(self) -> dict:
        """Flat figures, as LLM.memory_stats() gives them to users."""
        figures = {name: value for name, value in asdict(self).items() if name not in ("kv", "spec_decode")}
        figures.update(self.kv.to_dict())
        if self.spec_decode is not None:
            spec = self.spec_decode.to_dict()
            figures.update({f"spec_decode_{name}": value for name, value in spec.items()})
        figures["kv_cache_bytes"] = self.kv.num_blocks * self.kv.bytes_per_block
        return figures


class EngineCoreOutputs(msgspec.Struct):
    """One step's answer: every sequence with news, and the figures after it."""

    outputs: list[EngineCoreOutput]
    stats: EngineCoreStats
    # Requests that failed the model on their own this step (engine/step_isolation.py), ended
    # while the others went on, and the error.
    failed: list[str] = msgspec.field(default_factory=list)
    failure: str = ""
