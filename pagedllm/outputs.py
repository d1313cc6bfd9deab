"""What the engine hands back: shaped like vLLM's RequestOutput so its users feel at home."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str


# Per-step logprobs are many small objects: array_like encodes them as arrays (no field names on the
# wire) and gc=False keeps them out of the garbage collector (they hold no cycles).
class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Log-probability of the chosen token and the top-N alternatives (from the raw logits)."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely token
    top: list[tuple[int, float]]
    # The alternatives' ranks where they are not top's positions (logprob_token_ids' tokens)
    top_ranks: list[int] | None = None


# One dict per generated token: token id -> Logprob (the chosen token and the top-N).
SampleLogprobs = list[dict[int, Logprob]]
# The same for each prompt token; the first has none (nothing comes before it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_output_tokens: int = 0  # set when finished: the tokens of its longest output

    @property
    def time_to_first_token_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: PromptLogprobs | None = None  # if SamplingParams.prompt_logprobs asked


@dataclass
class PoolingOutput:
    """A pooling request's vector: an embedding, or a score request's label probabilities."""

    data: list[float]

    @property
    def embedding(self) -> list[float]:  # vLLM's name, for an embed request
        return self.data


@dataclass
class PoolingRequestOutput:
    """What a pooling request gives back, once, finished (vLLM's PoolingRequestOutput)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float  # how well a document answers the query, from 0 to 1


@dataclass
class ScoringRequestOutput:
    """LLM.score's answer for one document (vLLM's ScoringRequestOutput)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
