"""One request's state as the scheduler and the KV manager see it: token ids and counters."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, to be recomputed
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    """A request is only "tokens known" and "tokens computed": prefill chunks, decodes and
    recompute after preemption all follow from those two numbers."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()  # ids that end the request unless ignore_eos
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    # The LoRA adapter it runs with (None: the base model): its identity, which the prefix cache
    # hashes (LoRARequest.key), and its slot in the model's LoRA weights (the core's LoRASlots).
    lora_key: str | None = None
    lora_slot: int = -1
    priority: int = 0  # lower first, under --scheduling-policy priority (pagedllm.core.priority)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    # Prompt tokens the prefix cache served when the request was first admitted (-1 before),
    # and when that was.
    num_cached_tokens: int = field(default=-1, init=False)
    first_scheduled_time: float | None = field(default=None, init=False)
    # The scheduler's step that last ran it (-1: none yet): a group past its share of a step's
    # sequence slots runs those that waited longest (pagedllm.core.shares.resting).
    last_scheduled_step: int = field(default=-1, init=False)
    # prompt + generated ids, one list that only grows (appending is O(1)).
    token_ids: list[int] = field(init=False)
    # The stop token id that finished the request (None for EOS, length or a stop string).
    stop_reason: int | str | None = field(default=None, init=False)
    # Prefix-cache hashes of the request's full blocks, filled by the KV manager; tokens
    # only ever get appended, so they stay valid for the request's whole life.
    block_hashes: list[bytes] = field(default_factory=list, init=False, repr=False)
    # Speculative decoding: tokens proposed to follow token_ids, verified by the next step. Never
    # part of token_ids (so never hashed into the prefix cache, never counted as computed): the
    # accepted ones are appended to token_ids after verification, the list emptied.
    spec_token_ids: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def prefix_salt(self) -> str | tuple[str | None, str] | None:
        """What a cached first block must have been computed under to serve this request."""
        return self.cache_salt if self.lora_key is None else (self.cache_salt, self.lora_key)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def fork(self, request_id: str, last_token: int) -> Request:
        """A new request with this one's tokens but the last, then last_token: another sample
        from the same logits (n > 1) or another continuation of a beam."""
        if not self.num_output_tokens:
            raise ValueError(f"cannot fork {self.request_id}: it has no output token to replace")
        child = Request(request_id, self.prompt_token_ids, self.sampling_params,
                        eos_token_ids=self.eos_token_ids, arrival_time=self.arrival_time,
                        cache_salt=self.cache_salt, lora_key=self.lora_key, lora_slot=self.lora_slot,
                        priority=self.priority)
        child.token_ids.extend(self.token_ids[self.num_prompt_tokens:-1])
        child.append_token(last_token)
        return child
