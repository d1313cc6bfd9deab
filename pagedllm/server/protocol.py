"""OpenAI-compatible request bodies (pydantic), what happens to fields they do not declare, and
the error shape.

Every field a body declares is honoured (or, like `user`, documented in the README as accepted
and ignored). A field it does not declare is kept aside: one that would change what the answer
means and that this server does not implement (NOT_IMPLEMENTED_FIELDS) is refused with a 400
naming it; any other is ignored, and logged the first time its name is seen.
"""

from __future__ import annotations

import logging
import reprlib
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, WithJsonSchema
from pydantic_core import PydanticCustomError

from pagedllm.core.priority import MAX_PRIORITY, MIN_PRIORITY
from pagedllm.sampling_bounds import (
    LIST_BOUNDS,
    MAX_BAD_WORDS,
    MAX_LOGPROBS,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    NUMBER_BOUNDS,
    WHOLE_VOCABULARY,
)

logger = logging.getLogger(__name__)

# Limits on one request, past what SamplingParams checks (n, logprobs, stop strings).
MAX_PROMPTS_PER_REQUEST = 64  # a completion's list of prompts
# Fair shares (issue 32, finding 4): sequences one request may start, its prompts x n. 256 is the
# engine's default max_num_seqs: one request may fill a step, but not queue thousands (64 prompts
# x n=64 put 4,096 sequences ahead of every other client). The scheduler also admits least-served
# first (pagedllm.core.shares), so even these 256 do not hold the queue.
MAX_SEQUENCES_PER_REQUEST = 256
# Prompt logprobs' work per request (finding 5): the entries they build, prompt tokens x (k + 1)
# summed over its prompts (vLLM bounds k alone, with --max-logprobs). 65,536 entries are about
# 4 MB of JSON; the probe's 16-32 prompts x 20 alternatives built 23-46 MB over minutes.
MAX_PROMPT_LOGPROB_ENTRIES = 2**16
# Where the operator raised --max-logprobs past vLLM's default (to -1, say: the whole vocabulary),
# the budget is this: whole-vocabulary rows for 42 prompt tokens of SmolLM2's 49,152 (vLLM's
# test_chat_echo asks it of 29), about 700 MB in the server while it is answered (measured:
# 1.38 million entries, +476 MB offline, 5 s on 2 cores). Unbounded, one 4,000-token prompt
# would build 200 million entries, some 70 GB.
MAX_PROMPT_LOGPROB_ENTRIES_RAISED_CAP = 2**21
# Requests waiting for the engine past this many get a fast 503 (see AsyncEngine).
DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # larger bodies get a 413
# Connections (pagedllm.server.connections) and the body's time (the app's guard).
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_HEADER_TIMEOUT_S = 10.0  # request headers must arrive within this
DEFAULT_BODY_TIMEOUT_S = 30.0  # and the body within this: a 408, the connection closed
DEFAULT_KEEP_ALIVE_S = 5.0  # uvicorn's: an idle kept-alive connection closes after this


# Fields of OpenAI's or vLLM's API that change what the answer means and that this server does not
# implement: any value but null, or one listed here as meaning "off", gets a 400 naming the field.
# When one gets implemented, declare it on its body and take it out of here.
NOT_IMPLEMENTED_FIELDS: dict[str, tuple] = {
    # Structured outputs and tool calls beside those the bodies declare: one backend here
    # (llguidance), whitespace as spec.py's options say, and OpenAI's legacy function calling.
    "guided_decoding_backend": (), "guided_whitespace_pattern": (),
    "functions": ([],),
    "function_call": ("none",),
    # Other generation features.
    "suffix": ("",),
    "best_of": (1,),
    "prompt_embeds": ([],),  # [] embeds nothing: vLLM's clients send it beside a prompt
    "truncate_prompt_tokens": (),  # the pooling bodies'; completions and chat declare it
    "logits_processors": ([],),
    "chat_template": (),  # per request; the server's --chat-template is honoured
    "documents": ([],),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "mm_processor_kwargs": ({},),
    # vLLM's disaggregated prefill (a KV connector's settings; its prompt_token_ids replace the
    # prompt): no KV connector here, so an answer would silently be another request's.
    "kv_transfer_params": (),
}
# Names of ignored fields the log has mentioned (the log says each once); bounded, so that
# clients sending ever new names cannot grow it.
MAX_LOGGED_FIELD_NAMES = 1024


def prompt_logprob_budget(max_logprobs: int) -> int:
    """The prompt logprob entries one request may build under this --max-logprobs."""
    raised = max_logprobs == WHOLE_VOCABULARY or max_logprobs > MAX_LOGPROBS
    return MAX_PROMPT_LOGPROB_ENTRIES_RAISED_CAP if raised else MAX_PROMPT_LOGPROB_ENTRIES


class _Body(BaseModel):
    # Fields a body does not declare are kept in model_extra for check_extra_fields. NaN and
    # Infinity (which Python's JSON parser accepts) are not numbers anyone means.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    def extra_fields(self, path: str = "") -> dict[str, Any]:
        """The fields given that no body declares, here and in nested bodies, by their path
        ("messages[].name": list items under one name, for the log)."""
        found = {f"{path}{name}": value for name, value in (self.model_extra or {}).items()}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, _Body):
                found.update(value.extra_fields(f"{path}{name}."))
            elif isinstance(value, list):
                for item in value:
                    if isinstance(item, _Body):
                        found.update(item.extra_fields(f"{path}{name}[]."))
        return found


class ExtraFields:
    """What a server does with fields no body declares: refuse the not-implemented ones (top
    level), log the others once per name."""

    def __init__(self) -> None:
        self.logged: set[str] = set()

    def check(self, body: _Body, request_id: str) -> None:
        """APIError (400) for a not-implemented field with a value that is not "off"; a log
        line for each ignored field whose name was not logged before."""
        extra = body.extra_fields()
        for name, value in extra.items():
            off_values = NOT_IMPLEMENTED_FIELDS.get(name)
            if off_values is not None and value is not None and value not in off_values:
                raise APIError(f"{name} is not supported by this server; leave it out (or null)",
                               param=name, code="unsupported_field")
        new = [name for name in extra if name not in self.logged]
        if new and len(self.logged) < MAX_LOGGED_FIELD_NAMES:
            self.logged.update(new[:MAX_LOGGED_FIELD_NAMES - len(self.logged)])
            logger.warning("request %s: ignored fields the API does not define: %s", request_id,
                           reprlib.repr(sorted(new)))


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

# The strings pydantic's lax mode reads as booleans (any case, nothing around them): vLLM's bodies
# are lax, and its clients send `"logprobs": "true"`. Other strings, numbers and null stay refused.
BOOL_WORDS = {word: True for word in ("1", "on", "t", "true", "y", "yes")} | \
    {word: False for word in ("0", "off", "f", "false", "n", "no")}


def _bool_word(value):
    if isinstance(value, str) and value.isascii():
        return BOOL_WORDS.get(value.lower(), value)
    return value


def _bool_schema() -> dict:
    """What /openapi.json says a boolean field takes: true/false or a BOOL_WORDS string, in any
    case (JSON Schema's patterns have no case-insensitive flag: each letter is a class)."""
    spellings = ("".join(f"[{c}{c.upper()}]" if c.isalpha() else c for c in word) for word in BOOL_WORDS)
    return {"anyOf": [{"type": "boolean"}, {"type": "string", "pattern": f"^({'|'.join(spellings)})$"}]}


# Every boolean field of a request body: true/false, or one of BOOL_WORDS.
Bool = Annotated[StrictBool, BeforeValidator(_bool_word), WithJsonSchema(_bool_schema())]


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

# The ranges below are pagedllm.sampling_bounds' table (SamplingParams checks them again for
# library callers, the core on arrival); here they give a clear 400 before any work and document
# the limits in /openapi.json.
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_LEN), _UNICODE]
TokenId = Annotated[Int, Field(ge=0)]


def bounded(name: str, default=None):
    """A pydantic Field with the table's range for SamplingParams field `name`."""
    return Field(default, **NUMBER_BOUNDS[name].pydantic())


def logprob_count(name: str):
    """A logprobs count's Field: the table's range, -1 (the whole vocabulary) included; the
    engine's --max-logprobs is checked by server/logprob_counts.py."""
    return bounded(name)


class StreamOptions(_Body):
    include_usage: Bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (running counts that end
    # at the final usage chunk's).
    continuous_usage_stats: Bool = False


class _SamplingFields(_Body):
    model: Text | None = None
    n: Int = bounded("n", 1)
    temperature: Float | None = bounded("temperature")
    top_p: Float | None = bounded("top_p")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Int | None = bounded("seed")
    presence_penalty: Float = bounded("presence_penalty", 0.0)
    frequency_penalty: Float = bounded("frequency_penalty", 0.0)
    user: Text | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    # Token ids (as JSON keys are, strings) -> a bias in [-100, 100] added to their logits.
    logit_bias: Annotated[dict[Text, Float], Field(max_length=LIST_BOUNDS["logit_bias"])] | None = None
    # extras vLLM users rely on
    top_k: Int | None = bounded("top_k")  # above the vocabulary: every token
    min_p: Float | None = bounded("min_p")
    repetition_penalty: Float | None = bounded("repetition_penalty")
    ignore_eos: Bool = False
    min_tokens: Int = bounded("min_tokens", 0)
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    cache_salt: Annotated[str, Field(min_length=1), _UNICODE] | None = None
    # vLLM's: lower first, under --scheduling-policy priority (a 400 naming it under fcfs).
    priority: Int = Field(0, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    allowed_token_ids: Annotated[list[TokenId], Field(
        min_length=1, max_length=LIST_BOUNDS["allowed_token_ids"])] | None = None
    bad_words: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_LEN),
                                        _UNICODE]], Field(max_length=MAX_BAD_WORDS)] | None = None
    # vLLM's: with logprobs, each token's alternatives are these tokens (whatever their rank)
    # instead of the likeliest ones; the listed count then follows them, not logprobs/top_logprobs.
    logprob_token_ids: Annotated[list[TokenId], Field(
        min_length=1, max_length=LIST_BOUNDS["logprob_token_ids"])] | None = None
    # vLLM's: keep only this many of the prompt's tokens (-1: max_model_len), the last ones unless
    # truncation_side is "right" (pagedllm.engine.input_processor.PromptTruncation).
    truncate_prompt_tokens: Int | None = Field(None, ge=-1, le=2**63 - 1)
    truncation_side: Literal["left", "right"] | None = None
    # Log-probabilities of the prompt's tokens, this many alternatives each (not when streaming).
    prompt_logprobs: Int | None = logprob_count("prompt_logprobs")
    # logprobs name tokens "token_id:N" (None: the server's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: Bool | None = None
    # vLLM's: the prompt's token ids and each choice's generated ones in the answer
    return_token_ids: Bool = False
    # vLLM's beam search (server/beam_search.py): n beams, scored cum_logprob / len ** length_penalty
    use_beam_search: Bool = False
    length_penalty: Float = Field(1.0, ge=-10.0, le=10.0)
    early_stopping: Bool = False
    # Structured outputs: one constraint, in any of these spellings (OpenAI's, vLLM's, vLLM's
    # older ones). Their insides are checked by pagedllm.structured.spec, whose messages name
    # the field and what is wrong (a 400 either way).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None


class CompletionRequest(_SamplingFields):
    # Absent or null: a 400 in vLLM's words (server/api.py), which clients match on.
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]] | None = None
    max_tokens: Int | None = bounded("max_tokens", 16)
    logprobs: Int | None = logprob_count("logprobs")
    echo: Bool = False  # with logprobs: the prompt tokens' logprobs too
    add_special_tokens: Bool = True  # the tokenizer's BOS/EOS around a text prompt


class ContentPart(_Body):
    type: Text
    text: Text | None = None


class FunctionCall(_Body):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    """A call the assistant made earlier in the conversation."""

    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    # OpenAI's five roles, or any other the chat template takes (vLLM's custom roles): the
    # template renders it, or refuses it with a 400.
    role: Annotated[str, Field(min_length=1), _UNICODE]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: Text | None = None  # a tool message's: the call it answers

    def for_template(self) -> dict:
        """The message as chat templates read it: text content, and the tool fields if set."""
        message: dict = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

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
    max_tokens: Int | None = bounded("max_tokens")
    max_completion_tokens: Int | None = bounded("max_tokens")
    logprobs: Bool = False
    top_logprobs: Int | None = logprob_count("logprobs")
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False  # the prompt ends inside the last message
    # vLLM's: the answer's content starts with the last message's text where the answer continues
    # that message (an assistant's last message, or any last message without a generation prompt)
    echo: Bool = False
    add_special_tokens: Bool = False  # the template writes BOS itself
    chat_template_kwargs: dict[Text, Any] | None = None  # more variables for the chat template
    # vLLM's: at most this many tokens of reasoning, then its end marker is forced (needs the
    # server's --reasoning-parser; pagedllm.server.reasoning).
    thinking_token_budget: Int | None = Field(None, ge=1, le=2**31 - 1)
    # Checked by pagedllm.structured.tools, whose messages name the tool and what is wrong.
    tools: list[Any] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: Bool = True


class BatchChatCompletionRequest(ChatCompletionRequest):
    """vLLM's /v1/chat/completions/batch: several conversations under one set of parameters,
    answered together (choice i * n + j: conversation i's j-th answer); not streamed."""

    messages: Annotated[list[list[ChatMessage]], Field(min_length=1, max_length=MAX_PROMPTS_PER_REQUEST)]


class TokenizeCompletionRequest(_Body):
    """vLLM's /tokenize of a text."""

    model: Text | None = None
    prompt: Text
    add_special_tokens: Bool = True
    return_token_strs: Bool = False


class TokenizeChatRequest(_Body):
    """vLLM's /tokenize of a conversation, through the chat template."""

    model: Text | None = None
    messages: list[ChatMessage]
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    add_special_tokens: Bool = False
    chat_template_kwargs: dict[Text, Any] | None = None
    return_token_strs: Bool = False
    tools: list[Any] | None = None  # in the prompt, as a chat request's tools are


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[TokenId]


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
    """OpenAI's error type for a status: the client's fault below 500 (405, 408, 421 too)."""
    named = {401: "authentication_error", 404: "not_found_error", 503: "service_unavailable"}
    return named.get(status_code, "invalid_request_error" if status_code < 500 else "server_error")
