"""Server-wide choices about how answers are written, each one of vLLM's `serve` flags; a
request's own field, where it has one, wins."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AnswerOptions:
    # Logprobs name tokens "token_id:N" unless a request's return_tokens_as_token_ids says no.
    return_tokens_as_token_ids: bool = False
    # Every stream carries usage, on every chunk and in a last chunk, whatever its stream_options.
    force_include_usage: bool = False
    # Usage carries prompt_tokens_details.cached_tokens (the prompt tokens the prefix cache served);
    # off, it is null, as vLLM writes it unless --enable-prompt-tokens-details (clients and tests
    # that compare the whole usage object expect that). The Responses API counts them either way.
    prompt_tokens_details: bool = False
