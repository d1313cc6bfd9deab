"""OpenAI-compatible request bodies (pydantic) and the error shape."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool
from pydantic_core import PydanticCustomError

from pagedllm.sampling_params import MAX_LOGPROBS, MAX_N, MAX_STOP_STRING_LEN, MAX_STOP_STRINGS

# Limits on one request, past what SamplingParams checks (n, logprobs, stop strings).
MAX_PROMPTS_PER_REQUEST = 64  # a completion's list of prompts
MAX_STOP_TOKEN_IDS = 64  # each one is checked after every token
# Requests waiting for the engine past this many get a fast 503 (see AsyncEngine).
DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # larger bodies get a 413


class _Body(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do. NaN and Infinity (which
    # Python's JSON parser accepts) are not numbers anyone means.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def _json_number(kind: str) -> BeforeValidator:
    """Numbers as JSON Schema means them: 2.0 is an integer, but "16" is no max_tokens and
    false is no temperature (pydantic's lax mode would take both)."""
    message = "Input should be a valid integer" if kind == "int" else "Input should be a valid number"

    def check(value):
        if isinstance(value, (bool, str, bytes)):
            raise PydanticCustomError(f"{kind}_type", message)
        return value

    return BeforeValidator(check)


Int = Annotated[int, _json_number("int")]
Float = Annotated[float, _json_number("float")]


def _unicode(value: str) -> str:
    """JSON may spell a lone UTF-16 surrogate ("\\udbee"), which no tokenizer (nor UTF-8) can
    take: refuse it here rather than fail deep inside with a 500."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PydanticCustomError(
                "string_unicode", "Input should be a valid string; it holds a lone UTF-16 "
                "surrogate at position {position}", {"position": exc.start}) from None
    return value


_UNICODE = AfterValidator(_unicode)
Text = Annotated[str, _UNICODE]

# The ranges below are SamplingParams' (which checks them again for library callers); here they
# give a clear 400 before any work and document the limits in /openapi.json.
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_LEN), _UNICODE]
TokenId = Annotated[Int, Field(ge=0)]


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _SamplingFields(_Body):
    model: Text | None = None
    n: Int = Field(1, ge=1, le=MAX_N)
    temperature: Float | None = Field(None, ge=0, le=100)
    top_p: Float | None = Field(None, gt=0, le=1)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Int | None = Field(None, ge=-(2**63), lt=2**63)
    presence_penalty: Float = Field(0.0, ge=-2, le=2)
    frequency_penalty: Float = Field(0.0, ge=-2, le=2)
    user: Text | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Float] | None = None
    # extras vLLM users rely on
    top_k: Int | None = Field(None, ge=-1)
    min_p: Float | None = Field(None, ge=0, le=1)
    repetition_penalty: Float | None = Field(None, gt=0, le=2)
    ignore_eos: StrictBool = False
    min_tokens: Int = Field(0, ge=0)
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    cache_salt: Annotated[str, Field(min_length=1), _UNICODE] | None = None


class CompletionRequest(_SamplingFields):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int | None = Field(16, ge=1)
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False


class ContentPart(_Body):
    type: Text
    text: Text | None = None


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None

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
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """Every error the server answers with, in OpenAI's shape (documented in /openapi.json)."""

    error: ErrorInfo


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
