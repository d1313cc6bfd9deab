"""How many alternatives a request's logprobs fields ask for, -1 included: vLLM's spelling of "the
whole vocabulary" for logprobs, top_logprobs and prompt_logprobs.

-1 is resolved to the model's vocabulary size and then held to the same cap as any other count
(pagedllm.sampling_bounds.MAX_LOGPROBS, vLLM's --max-logprobs default): every alternative is a
dict entry per token in the answer, so a model's whole vocabulary (49,152 tokens for SmolLM2)
per token is refused with a 400 that says so, as vLLM refuses it under its default cap, rather
than letting one request build megabytes per token."""

from __future__ import annotations

from pagedllm.sampling_bounds import MAX_LOGPROBS
from pagedllm.server.protocol import WHOLE_VOCABULARY, APIError


def resolve_count(name: str, requested: int | None, vocab_size: int) -> int | None:
    """requested, with -1 made the vocabulary size; a 400 naming the field if that is past the
    cap."""
    if requested != WHOLE_VOCABULARY:
        return requested
    if vocab_size > MAX_LOGPROBS:
        raise APIError(f"{name}=-1 asks for every token of the vocabulary ({vocab_size} tokens) at "
                       f"each position; this server lists at most {MAX_LOGPROBS} alternatives per "
                       f"token: ask for {MAX_LOGPROBS} or fewer", param=name)
    return vocab_size
