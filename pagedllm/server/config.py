"""ServerConfig: what `pagedllm serve` takes past the engine's settings, each declared once (type,
default, help; its flag derived from it as the engine's are: pagedllm.config) and validated in one
place, before the minutes a model load may take. The API key's value is read where it may come
from (flag, file, environment) by pagedllm.server.keys."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pagedllm.config import check_fields, check_positive_int, check_positive_seconds, setting
from pagedllm.server.keys import API_KEY_ENV, VLLM_API_KEY_ENV, read_api_key
from pagedllm.server.protocol import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_WAITING_REQUESTS,
)
from pagedllm.text.reasoning import REASONING_PARSER_NAMES, reasoning_format

CONNECTIONS = "connections"
CORS = "CORS (off unless --allowed-origins is given)"


def string_list(text: str) -> tuple[str, ...]:
    """A JSON list of strings (vLLM's form) or comma-separated strings."""
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON list: {exc}") from None
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise ValueError("the list must hold strings")
        return tuple(items)
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _port(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError(f"{name} must be a TCP port, 0 to 65535 (0: any free one); got {value!r}")


def _root_path(name: str, value) -> None:
    if not isinstance(value, str) or (value and (not value.startswith("/") or value.endswith("/"))):
        raise ValueError(f"{name} must be a URL path that starts with '/' and does not end with one "
                         f"(like /llm); got {value!r}")


def _reasoning_parser(name: str, value) -> None:
    """One line naming the known parsers (not argparse's usage screen: the settings check it)."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a parser's name; got {value!r}")
    reasoning_format(value)


@dataclass(frozen=True)
class ServerConfig:
    host: str = setting("127.0.0.1", "address to bind (loopback only by default; 0.0.0.0 exposes it)")
    port: int = setting(8000, "port to listen on", check=_port)
    uds: str | None = setting(
        None, "serve on this Unix domain socket (a file path) instead of --host and --port")
    root_path: str = setting(
        "", "the path prefix a proxy serves the API under (like /llm): routes answer with and "
        "without it, and /openapi.json names it", check=_root_path)
    api_key: str | None = setting(
        None, "require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize and on the live "
        "data of the dashboard at / (the page asks for it); or set "
        f"{API_KEY_ENV} (or {VLLM_API_KEY_ENV}), or --api-key-file, so that the key is not in the "
        "process list", secret=True)
    api_key_file: str | None = setting(None, "a file holding the API key (its first line)")
    served_model_name: str | None = setting(
        None, "the model's name in the API (default: --model, or the default model's name)")
    chat_template: str | None = setting(
        None, "a Jinja chat template, or a file holding one, for every chat request instead of the "
        "model's")
    reasoning_parser: str | None = setting(
        None, "return a thinking model's reasoning apart from its answer (message.reasoning_content "
        "and .reasoning, and in stream deltas), by vLLM's parser names; also lets "
        "response_format and tools apply after the reasoning and caps it with a request's "
        f"thinking_token_budget: {', '.join(REASONING_PARSER_NAMES)}", check=_reasoning_parser)
    return_tokens_as_token_ids: bool = setting(
        False, "logprobs name tokens 'token_id:N' (ids are unambiguous, text pieces are not) "
        "unless a request's return_tokens_as_token_ids says false")
    enable_force_include_usage: bool = setting(
        False, "every stream carries the usage so far on every chunk and in a last chunk, "
        "whatever its stream_options")
    enable_prompt_tokens_details: bool = setting(
        False, "usage carries prompt_tokens_details.cached_tokens, the prompt tokens the prefix "
        "cache served (off: null, as vLLM)")
    enable_tokenizer_info_endpoint: bool = setting(
        False, "serve /tokenizer_info: the tokenizer's settings and the chat template "
        "(tokenizer_config.json's shape), for clients that tokenize on their side")
    max_body_bytes: int = setting(
        DEFAULT_MAX_BODY_BYTES, "larger request bodies get 413", check=check_positive_int)
    max_waiting_requests: int = setting(
        DEFAULT_MAX_WAITING_REQUESTS, "requests past this many waiting for the engine get a fast "
        "503 with Retry-After", check=check_positive_int)
    num_threads: int | None = setting(
        None, "torch threads of the engine core process (default: one per core; fewer where other "
        "busy processes share the cores)", check=check_positive_int)
    max_connections: int = setting(
        DEFAULT_MAX_CONNECTIONS, "open connections at most (kept under the open-files limit): past "
        "it the oldest one still waiting for its request headers is closed, or, when all are busy, "
        "a new one gets 503", check=check_positive_int, group=CONNECTIONS)
    header_timeout_s: float = setting(
        DEFAULT_HEADER_TIMEOUT_S, "a connection's request headers must arrive within this many "
        "seconds, or it is closed", check=check_positive_seconds, group=CONNECTIONS)
    body_timeout_s: float = setting(
        DEFAULT_BODY_TIMEOUT_S, "a request's body must arrive within this many seconds, or it gets "
        "408 and the connection is closed", check=check_positive_seconds, group=CONNECTIONS)
    keep_alive_s: float = setting(
        DEFAULT_KEEP_ALIVE_S, "an idle kept-alive connection is closed after this many seconds",
        check=check_positive_seconds, group=CONNECTIONS)
    allowed_hosts: tuple[str, ...] | None = setting(
        None, "Host header values accepted (a JSON list or comma-separated; a port may follow "
        "each); others get 421. Default: for a loopback --host, localhost, 127.0.0.1 and [::1] "
        "(against DNS rebinding); otherwise any. '*' accepts any", parse=string_list, group=CONNECTIONS)
    allowed_origins: tuple[str, ...] | None = setting(
        None, 'origins browsers may call from: a JSON list (\'["https://a.example"]\', \'["*"]\') '
        "or comma-separated", parse=string_list, group=CORS)
    allowed_methods: tuple[str, ...] = setting(
        ("*",), "HTTP methods those origins may use", parse=string_list, group=CORS)
    allowed_headers: tuple[str, ...] = setting(
        ("*",), "request headers those origins may send", parse=string_list, group=CORS)
    allow_credentials: bool = setting(
        False, "let those origins send cookies and credentials", group=CORS)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("give the API key one way: --api-key or --api-key-file, not both")

    def resolve_api_key(self) -> str | None:
        """The key from --api-key, --api-key-file or the environment; None: an open server.
        ValueError for an unreadable file or an empty key."""
        return read_api_key(self.api_key, self.api_key_file)
