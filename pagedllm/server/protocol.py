"""OpenAI-compatible request bodies (pydantic) and the error shape."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP_ITEMS = 16
# Limits on one request, past what SamplingParams checks (n, logprobs, stop strings).
MAX_PROMPTS_PER_REQUEST = 64  # a completion's list of prompts
MAX_STOP_TOKEN_IDS = 64  # each one is checked after every token
# Requests waiting for the engine past this many get a fast 503 (see AsyncEngine).
DEFAULT_MAX_WAITING_REQUESTS = 1024


class _Body(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # extras vLLM users rely on
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(default=None, min_length=1)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"message content part of type {part.type!r} is not supported; "
                                 "only text parts are")
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class APIError(Exception):
    """An error the client caused or must see, with OpenAI's error fields."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 error_type: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.error_type = error_type or _type_for(status_code)
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.error_type, self.param, self.code)


def error_body(message: str, error_type: str, param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _type_for(status_code: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error", 503: "service_unavailable"}.get(status_code, "server_error")
