"""How many alternatives a request's logprobs fields ask for, -1 included: vLLM's spelling of "the
whole vocabulary" for logprobs, top_logprobs and prompt_logprobs.

Every count, -1 resolved to the model's vocabulary size, is held to the engine's cap
(pagedllm.sampling_bounds.logprobs_cap: --max-logprobs, default 20 as vLLM's, -1 the whole
vocabulary): every alternative is a dict entry per token in the answer, so under the default a
model's whole vocabulary (49,152 tokens for SmolLM2) per token is refused with a 400 that says so
and how to raise the cap, as vLLM refuses it, rather than letting one request build megabytes per
token. The field is named as the request spelled it (top_logprobs on chat), which the input
processor's own check on the resolved SamplingParams cannot do."""

from __future__ import annotations

from pagedllm.sampling_bounds import WHOLE_VOCABULARY, cap_reason, logprobs_cap
from pagedllm.server.protocol import APIError


def resolve_count(name: str, requested: int | None, vocab_size: int, max_logprobs: int) -> int | None:
    """requested, with -1 made the vocabulary size; a 400 naming the field if that is past the
    engine's cap."""
    if requested is None:
        return None
    count = vocab_size if requested == WHOLE_VOCABULARY else requested
    cap = logprobs_cap(max_logprobs, vocab_size)
    if count > cap:
        asked = (f"{name}=-1 asks for every token of the vocabulary ({vocab_size} tokens) at each "
                 f"position" if requested == WHOLE_VOCABULARY else f"{name}={requested} asks for "
                 f"{requested} alternatives per token")
        raise APIError(f"{asked}; this server lists at most {cap} {cap_reason(max_logprobs, vocab_size)}: "
                       f"ask for {cap} or fewer", param=name)
    return count
