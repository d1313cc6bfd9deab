"""The OpenAI-compatible HTTP API over one AsyncEngine."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import reprlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm import __version__
from pagedllm.engine.input_processor import InvalidInput, PromptInput, prompt_list
from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestFailed
from pagedllm.server.dashboard import EVENTS_PATH, dashboard_router, engine_snapshot_fn
from pagedllm.server.hosts import host_allowed
from pagedllm.server.limits import InputWorkers, RequestPrecheck
from pagedllm.server.metrics import ServerMetrics
from pagedllm.server.protocol import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    MAX_PROMPTS_PER_REQUEST,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    ExtraFields,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    error_body,
)
from pagedllm.server.structured import OutputConstraint, ToolCallReader, read_constraint_async
from pagedllm.structured.spec import GrammarSpec
from pagedllm.structured.tools import Tool
from pagedllm.text.chat_template import TemplateTimeout

logger = logging.getLogger(__name__)

# What /openapi.json documents, so that clients (and the fuzz test) know every answer there is.
_ERROR = {"model": ErrorResponse}
_V1_ERRORS = {401: {**_ERROR, "description": "Missing or wrong API key"},
              408: {**_ERROR, "description": "The request body did not arrive in time"},
              413: {**_ERROR, "description": "Request body too large"},
              421: {**_ERROR, "description": "A Host this server does not answer for"}}
_GENERATE_RESPONSES = {
    200: {"description": "The completion, or with stream=true server-sent events",
          "content": {"application/json": {}, "text/event-stream": {}}},
    400: {**_ERROR, "description": "Invalid request"},
    404: {**_ERROR, "description": "No such model"},
    500: {**_ERROR, "description": "The engine failed while running the request"},
    503: {**_ERROR, "description": "Overloaded (too many waiting requests) or engine dead; "
                                   "see Retry-After"},
    **_V1_ERRORS,
}
_TOKENIZE_RESPONSES = {400: {**_ERROR, "description": "Invalid request"},
                       404: {**_ERROR, "description": "No such model"}, **_V1_ERRORS}
# Paths the API key guards (the dashboard's page itself loads without it, and asks for it).
_GUARDED_PATHS = ("/v1/", "/tokenize", "/detokenize", EVENTS_PATH)
# Bodies measured by RequestPrecheck before the schema reads them.
_PRECHECKED_PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


@dataclass(frozen=True)
class Cors:
    """Cross-origin access for browsers (vLLM's flags: --allowed-origins, --allowed-methods,
    --allowed-headers, --allow-credentials). No Cors, no CORS headers: browsers on other origins
    are refused, as without a CORS layer at all."""

    allowed_origins: tuple[str, ...]
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, chat_template: str | None = None,
              cors: Cors | None = None, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
              allowed_hosts: tuple[str, ...] | None = None) -> FastAPI:
    """The app over engine. chat_template: replaces the model's for every chat request;
    allowed_hosts: the Host names answered (pagedllm.server.hosts; None: any)."""
    metrics = ServerMetrics(lambda: engine.stats)
    engine.on_finished = metrics.observe_finished
    workers = InputWorkers()
    api = _Api(engine, model_name, chat_template, workers)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            workers.close()
            await engine.stop()

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    _install_error_handlers(app)
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes,
                       body_timeout_s=body_timeout_s,
                       precheck=RequestPrecheck(engine.input_processor, workers),
                       allowed_hosts=allowed_hosts)
    if cors is not None:  # added last, so outermost: it answers preflights before the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                           allow_methods=list(cors.allowed_methods),
                           allow_headers=list(cors.allowed_headers),
                           allow_credentials=cors.allow_credentials)

    @app.get("/health", response_class=Response, responses={
        200: {"description": "Serving", "content": {}},
        503: {**_ERROR, "description": "The engine is dead: restart the server"}})
    async def health():
        if engine.healthy:
            return Response(status_code=200)
        return _error(APIError(engine.dead_reason or "engine not running", 503))

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics", response_class=Response, responses={
        200: {"description": "Prometheus metrics", "content": {CONTENT_TYPE_LATEST: {}}}})
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=_V1_ERRORS)
    async def models():
        return {"object": "list", "data": [api.model_card()]}

    @app.post("/v1/completions", responses=_GENERATE_RESPONSES)
    async def completions(body: CompletionRequest, raw: Request):
        return await api.completions(body, raw)

    @app.post("/v1/chat/completions", responses=_GENERATE_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await api.chat(body, raw)

    @app.post("/tokenize", responses=_TOKENIZE_RESPONSES)
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest):
        return await workers.run(api.tokenize, body)

    @app.post("/detokenize", responses=_TOKENIZE_RESPONSES)
    async def detokenize(body: DetokenizeRequest):
        return await workers.run(api.detokenize, body)

    app.include_router(dashboard_router(engine_snapshot_fn(engine)))
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        return _error(APIError(_describe_validation(exc), 400, param=_first_param(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        return _error(APIError(str(exc.detail), exc.status_code))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception):
        logger.exception("unexpected error")
        return _error(APIError("internal server error", 500, error_type="server_error"))


class _Guard:
    """The Host header (pagedllm.server.hosts), the API key (on /v1/*, /tokenize, /detokenize and
    the dashboard's events), the body's size and time limits, and the cheap bounds on a JSON body
    (RequestPrecheck), checked before any endpoint runs.

    Plain ASGI rather than an http middleware, so that it can count a body sent in chunks
    (no Content-Length) as it arrives and refuse it past the limit without buffering more, and
    give up on a body that arrives too slowly (uvicorn has no body timeout)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                 precheck: RequestPrecheck | None = None,
                 allowed_hosts: tuple[str, ...] | None = None) -> None:
        self.app = app
        self.allowed_hosts = allowed_hosts
        self.expected_auth = f"Bearer {api_key}".encode() if api_key is not None else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.precheck = precheck

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self.allowed_hosts is not None and not host_allowed(headers.get("host"), self.allowed_hosts):
            await _error(APIError(f"this server does not answer for host {_short(headers.get('host'))}"
                                  " (see --allowed-hosts)", 421, code="misdirected_request")
                         )(scope, receive, send)
            return
        if self.expected_auth is not None and scope["path"].startswith(_GUARDED_PATHS):
            given = headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, self.expected_auth):  # constant time
                await _error(APIError("invalid or missing API key: send 'Authorization: Bearer "
                                      "<key>'", 401))(scope, receive, send)
                return
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(f"{length} bytes")(scope, receive, send)
            return
        if scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await self._read_limited(receive)
        except TimeoutError:  # a client sending its body slowly holds a connection: close it
            error = APIError(f"the request body did not arrive within {self.body_timeout_s:g} s",
                             408, code="request_timeout")
            await _error(error, close=True)(scope, receive, send)
            return
        if body is None:
            await self._too_large("larger (sent in chunks, without Content-Length)")(scope, receive, send)
            return
        if self.precheck is not None and scope["path"] in _PRECHECKED_PATHS:
            error = await self.precheck.check(body)
            if error is not None:
                await _error(error)(scope, receive, send)
                return
        await self.app(scope, _replay(body, receive), send)

    async def _read_limited(self, receive: Receive) -> bytes | None:
        """The whole body, or None as soon as it passes the limit."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, size: str) -> JSONResponse:
        return _error(APIError(f"the request body is {size}; the limit is {self.max_body_bytes} "
                               "bytes", 413, code="request_too_large"))


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the already-read body once, then passes on (e.g. disconnects)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def _error(exc: APIError, close: bool = False) -> JSONResponse:
    """exc in OpenAI's shape; close: end the connection after it (uvicorn does, on this header)."""
    headers = {"Retry-After": "1"} if exc.status_code == 503 else {}
    if close:
        headers["Connection"] = "close"
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=headers)


def _describe_validation(exc: RequestValidationError) -> str:
    problems = []
    for err in _most_specific(exc.errors()):
        loc = ".".join(_field_path(err))
        msg = str(err.get("msg", "invalid"))
        if err.get("type") == "json_invalid":
            problem = "the body is not valid JSON"
        elif err.get("type") in ("model_attributes_type", "dict_type") and not loc:
            problem = "the body must be a JSON object"
        elif msg.startswith("Input should be "):  # "n must be less than or equal to 64; got 65"
            got = reprlib.repr(err.get("input"))  # bounded, however large the input
            problem = f"{loc or 'body'} must be {msg.removeprefix('Input should be ')}; got {got}"
        else:
            problem = f"{loc or 'body'}: {msg}"
        if problem not in problems:
            problems.append(problem)
    return "invalid request: " + "; ".join(problems[:5])


def _most_specific(errors) -> list[dict]:
    """A value that fits no branch of a union (say stop=[""] against str | list[str]) fails
    each branch: keep the errors about its content, not the type mismatches of other branches."""
    def is_type_error(err: dict) -> bool:
        return str(err.get("type", "")).endswith(("_type", "_parsing"))

    specific = {tuple(_field_path(e)[:1]) for e in errors if not is_type_error(e)}
    return [e for e in errors if not (is_type_error(e) and tuple(_field_path(e)[:1]) in specific)]


def _field_path(err: dict) -> list[str]:
    """The field names and list indexes of an error's location, without pydantic's union
    branch tags ('str', 'list[int]', 'constrained-str', ...)."""
    path = []
    for part in err.get("loc", ()):
        if isinstance(part, int):
            path.append(str(part))
        elif part != "body" and part.isidentifier() and part not in _TYPE_TAGS:
            path.append(part)
    return path


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _first_param(exc: RequestValidationError) -> str | None:
    for err in exc.errors():
        if err.get("type") == "json_invalid":  # its location is a character offset
            continue
        path = _field_path(err)
        if path:
            return path[0]
    return None


class _Api:
    """The endpoint logic: turn OpenAI bodies into engine requests and outputs into responses.
    Prompts are checked and tokenized by the engine's input processor, as everywhere else, in the
    input workers (templates and tokenizing never run on the event loop)."""

    def __init__(self, engine: AsyncEngine, model_name: str, chat_template: str | None,
                 workers: InputWorkers) -> None:
        self.engine = engine
        self.workers = workers
        self.model_name = model_name
        self.chat_template = chat_template  # None: the model's
        self.processor = engine.input_processor
        self.max_model_len = self.processor.max_model_len
        self.extra_fields = ExtraFields()

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "pagedllm",
                "max_model_len": self.max_model_len}

    # -- endpoints -----------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, raw: Request):
        response_id = f"cmpl-{uuid.uuid4().hex}"
        self._check_common(body, response_id)
        prompts = _completion_prompts(body.prompt)
        # echo with logprobs: the prompt's tokens get theirs too (vLLM's rule).
        prompt_logprobs = body.prompt_logprobs
        if prompt_logprobs is None and body.echo:
            prompt_logprobs = body.logprobs
        constraint = await read_constraint_async(body, self.processor, self.chat_template)
        params = self._sampling_params(body, body.max_tokens, body.logprobs, prompt_logprobs,
                                       constraint.spec)
        requests = await self.workers.run(self._process, response_id, body, prompts, params,
                                          "prompt", add_special_tokens=body.add_special_tokens)
        return await self._respond(body, raw, response_id, requests, _CompletionFormat(self, body))

    async def chat(self, body: ChatCompletionRequest, raw: Request):
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        self._check_common(body, response_id)
        constraint = await read_constraint_async(body, self.processor, self.chat_template)
        prompt = await self.workers.run(self._chat_prompt, body, constraint.tools)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self._sampling_params(body, max_tokens, logprobs, body.prompt_logprobs, constraint.spec)
        requests = await self.workers.run(self._process, response_id, body, [prompt], params,
                                          "messages")
        return await self._respond(body, raw, response_id, requests, _ChatFormat(self, body, constraint))

    def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        """vLLM's /tokenize: a text's or a conversation's token ids, with the context length."""
        self._check_model(body)
        self.extra_fields.check(body, "tokenize")
        if isinstance(body, TokenizeChatRequest):
            token_ids = self._chat_prompt(body)["prompt_token_ids"]
        else:
            try:
                token_ids = self.processor.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            except InvalidInput as exc:
                raise APIError(str(exc), param=exc.param) from exc
        decode = self.processor.tokenizer.decode
        token_strs = [decode([t], skip_special_tokens=False) for t in token_ids] \
            if body.return_token_strs else None
        return {"count": len(token_ids), "max_model_len": self.max_model_len, "tokens": token_ids,
                "token_strs": token_strs}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        """vLLM's /detokenize: the text of token ids."""
        self._check_model(body)
        self.extra_fields.check(body, "detokenize")
        try:
            return {"prompt": self.processor.detokenize(body.tokens)}
        except InvalidInput as exc:
            raise APIError(str(exc), param=exc.param) from exc

    def _chat_prompt(self, body: ChatCompletionRequest | TokenizeChatRequest,
                     tools: Sequence[Tool] = ()) -> dict:
        """The conversation (and tools) through the chat template (the server's
        --chat-template, else the model's): {"prompt": text, "prompt_token_ids": ids}."""
        try:
            messages = [m.for_template() for m in body.messages]
            return self.processor.chat_prompt(
                messages, body.add_generation_prompt, tools=tools, chat_template=self.chat_template,
                chat_template_kwargs=body.chat_template_kwargs,
                continue_final_message=body.continue_final_message,
                add_special_tokens=body.add_special_tokens)
        except InvalidInput as exc:
            raise APIError(str(exc), param=exc.param) from exc
        except ValueError as exc:  # a content part that is not text
            raise APIError(str(exc), param="messages") from exc
        except TemplateTimeout as exc:  # the server's template is at fault, not the request
            logger.error("chat template cut by its time budget: %s", exc)
            raise APIError(f"{exc}; the server's chat template is at fault, not this request",
                           500, error_type="server_error", code="chat_template_timeout") from exc

    # -- checks --------------------------------------------------------------------------------
    def _check_model(self, body) -> None:
        if body.model is not None and body.model != self.model_name:
            raise APIError(f"model {_short(body.model)} does not exist; this server serves "
                           f"{self.model_name!r}", 404, param="model", code="model_not_found")

    def _check_common(self, body, response_id: str) -> None:
        self._check_model(body)
        self.extra_fields.check(body, response_id)
        if body.stream_options is not None and not body.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")
        if body.prompt_logprobs is not None and body.stream:
            raise APIError("prompt_logprobs is not available when streaming; leave it out or set "
                           "stream to false (echo with logprobs streams the prompt's logprobs)",
                           param="prompt_logprobs")

    def _sampling_params(self, body, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None,
                         structured_outputs: GrammarSpec | None) -> SamplingParams:
        """The body's sampling fields; one it leaves out (null) takes the model's default
        (generation_config.json, unless --generation-config none), else SamplingParams'.
        max_tokens=None stays: the input processor makes it the room left in the context."""
        given = dict(
            n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            min_p=body.min_p, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
            seed=body.seed, min_tokens=body.min_tokens, stop=body.stop,
            stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, logit_bias=_token_id_keys(body.logit_bias),
            allowed_token_ids=body.allowed_token_ids, bad_words=body.bad_words,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            structured_outputs=structured_outputs)
        fields = {**self.processor.sampling_defaults,
                  **{name: value for name, value in given.items() if value is not None}}
        fields["max_tokens"] = max_tokens
        fields["output_kind"] = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
        try:
            return SamplingParams(**fields)
        except ValueError as exc:
            raise APIError(str(exc), param=str(exc).split(" ", 1)[0]) from exc

    def _process(self, response_id: str, body, prompts, params: SamplingParams, prompt_param: str,
                 add_special_tokens: bool = True) -> list[tuple[str | None, EngineCoreRequest]]:
        """Each prompt through the input processor: checked, tokenized, max_tokens fitted."""
        try:
            return [self.processor.process(f"{response_id}-{i}", prompt, params,
                                           cache_salt=body.cache_salt, max_tokens_must_fit=True,
                                           add_special_tokens=add_special_tokens)
                    for i, prompt in enumerate(prompts)]
        except InvalidInput as exc:
            raise APIError(str(exc), param=prompt_param if exc.param == "prompt" else exc.param) from exc
        except ValueError as exc:  # max_tokens fitted into the room left broke a sampling rule
            raise APIError(str(exc), param=str(exc).split(" ", 1)[0]) from exc

    # -- running -------------------------------------------------------------------------------
    async def _respond(self, body, raw: Request, response_id: str,
                       requests: list[tuple[str | None, EngineCoreRequest]], fmt):
        streams = await self._start(requests)
        prompts = [(text, request.prompt_token_ids) for text, request in requests]
        if body.stream:
            return StreamingResponse(fmt.stream(response_id, streams, prompts),
                                     media_type="text/event-stream")
        finals = await _collect_or_abort(streams, raw)
        return fmt.full(response_id, finals, prompts)

    async def _start(self, requests: list[tuple[str | None, EngineCoreRequest]]) -> list[AsyncIterator]:
        streams = []
        try:
            self.engine.check_room(len(requests))  # all or none of a request's prompts
            for text, request in requests:
                streams.append(await self.engine.generate(request, text))
        except ValueError as exc:
            await _close_all(streams)
            raise APIError(str(exc), param="prompt") from exc
        except QueueFullError as exc:
            await _close_all(streams)
            raise APIError(str(exc), 503, code="server_overloaded") from exc
        except EngineDeadError as exc:
            await _close_all(streams)
            raise APIError(str(exc), 503) from exc
        return streams


_CLIENT_STRING = reprlib.Repr()
_CLIENT_STRING.maxstring = _CLIENT_STRING.maxother = 100


def _short(value) -> str:
    """A client's value, quoted and cut to about 100 characters, for an error message."""
    return _CLIENT_STRING.repr(value)


def _token_id_keys(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias, keyed by token ids written as strings, keyed by the ids (the input
    processor checks their range). Keys that are no integer: a 400 naming them all."""
    if logit_bias is None:
        return None
    keys = {key: _as_int(key) for key in logit_bias}
    bad = [key for key, token_id in keys.items() if token_id is None]
    if bad:
        raise APIError(f"logit_bias keys must be token ids (integers written as strings); not "
                       f"integers: {reprlib.repr(bad)}", param="logit_bias")
    return {keys[key]: value for key, value in logit_bias.items()}


def _as_int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _completion_prompts(prompt) -> list[PromptInput]:
    """OpenAI's prompt field (text, texts, token ids, lists of token ids) as a list of prompts;
    [] is one empty prompt, for the input processor to refuse."""
    prompts = prompt_list(prompt) or [prompt]
    if len(prompts) > MAX_PROMPTS_PER_REQUEST:
        raise APIError(f"prompt may list at most {MAX_PROMPTS_PER_REQUEST} prompts; got "
                       f"{len(prompts)}", param="prompt")
    return prompts


async def _close_all(streams) -> None:
    for stream in streams:
        await stream.aclose()


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for output in stream:
        last = output
    return last


async def _collect_or_abort(streams, raw: Request) -> list[RequestOutput]:
    """Wait for every request's final output; abort them all if the client goes away."""
    tasks = [asyncio.ensure_future(_last(s)) for s in streams]
    gathered = asyncio.ensure_future(asyncio.gather(*tasks))
    watcher = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        await asyncio.wait([gathered, watcher], return_when=asyncio.FIRST_COMPLETED)
        if not gathered.done():
            raise APIError("client disconnected", 499)
        try:
            return gathered.result()
        except RequestFailed as exc:
            raise APIError(str(exc), 500, error_type="server_error") from exc
        except EngineDeadError as exc:
            raise APIError(str(exc), 503) from exc
    finally:
        watcher.cancel()
        if not gathered.done():
            gathered.cancel()
            for task in tasks:
                task.cancel()
            # Both awaited, the gathering future too: cancelled, it ends with a CancelledError
            # that asyncio would otherwise log as "exception was never retrieved".
            await asyncio.gather(*tasks, gathered, return_exceptions=True)
            await _close_all(streams)


async def _wait_disconnect(raw: Request) -> None:
    while not await raw.is_disconnected():
        await asyncio.sleep(0.2)


async def _merge(streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come, tagged with the prompt index."""
    queue: asyncio.Queue = asyncio.Queue()
    sentinel = object()

    async def pump(i: int, stream) -> None:
        try:
            async for output in stream:
                await queue.put((i, output))
            await queue.put((i, sentinel))
        except Exception as exc:
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is sentinel:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close_all(streams)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _prompt_logprobs_json(entries: PromptLogprobs | None) -> list[dict | None] | None:
    """RequestOutput.prompt_logprobs as vLLM's API shows them: per prompt token (the first None),
    token id -> {logprob, rank, decoded_token}."""
    if entries is None:
        return None
    return [None if entry is None else {str(tid): _logprob_json(lp) for tid, lp in entry.items()}
            for entry in entries]


def _logprob_json(lp: Logprob) -> dict:
    return {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}


class _Format:
    """Shared by both endpoints: choice bookkeeping, usage and the streaming loop. One per
    response."""

    object_full = ""
    object_chunk = ""

    def __init__(self, api: _Api, body) -> None:
        self.api = api
        self.body = body
        self.n = body.n

    def token_text(self, token_id: int, lp: Logprob | None = None) -> str:
        """How logprobs name a token: its text, or "token_id:N" if the body asks (vLLM's
        return_tokens_as_token_ids: text pieces can be ambiguous, ids are not)."""
        if self.body.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        if lp is not None:
            return lp.decoded_token
        return self.api.processor.tokenizer.decode([token_id], skip_special_tokens=False)

    def usage(self, prompts, completion_tokens: int, cached_tokens: int) -> dict:
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def full(self, response_id: str, finals: list[RequestOutput], prompts) -> dict:
        choices, generated = [], 0
        for i, final in enumerate(finals):
            for out in final.outputs:
                choices.append(self.full_choice(i * self.n + out.index, out, prompts[i], final))
                generated += len(out.token_ids)
        response = {"id": response_id, "object": self.object_full, "created": int(time.time()),
                    "model": self.api.model_name, "choices": choices,
                    "usage": self.usage(prompts, generated, sum(f.num_cached_tokens for f in finals))}
        return self.finish_response(response, finals)

    def finish_response(self, response: dict, finals: list[RequestOutput]) -> dict:
        return response

    async def stream(self, response_id: str, streams, prompts) -> AsyncIterator[str]:
        """Server-sent events from DELTA outputs: each holds only what is new."""
        created = int(time.time())
        generated: dict[int, int] = {}  # tokens sent per choice
        cached: dict[int, int] = {}  # prefix-cache hits per prompt
        prompt_logprobs: dict[int, PromptLogprobs] = {}  # per prompt, from its first output
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)

        def chunk(choices: list[dict]) -> str:
            return _sse({"id": response_id, "object": self.object_chunk, "created": created,
                         "model": self.api.model_name, "choices": choices})

        try:
            for first in self.opening_chunks(len(prompts)):
                yield chunk(first)
            async for i, output in _merge(streams):
                cached[i] = output.num_cached_tokens
                if output.prompt_logprobs is not None:
                    prompt_logprobs[i] = output.prompt_logprobs
                choices = []
                for out in output.outputs:
                    index = i * self.n + out.index
                    first = index not in generated
                    generated[index] = generated.get(index, 0) + len(out.token_ids)
                    choices.append(self.delta_choice(index, out, prompts[i], first,
                                                     prompt_logprobs.get(i)))
                if choices:
                    yield chunk(choices)
            if include_usage:
                yield _sse({"id": response_id, "object": self.object_chunk, "created": created,
                            "model": self.api.model_name, "choices": [],
                            "usage": self.usage(prompts, sum(generated.values()), sum(cached.values()))})
        except (RequestFailed, EngineDeadError) as exc:
            yield _sse(error_body(str(exc), "server_error", code=500))
        except asyncio.CancelledError:  # the server stopped it (its shutdown grace ran out)
            yield _sse(error_body("the server is shutting down and cut this stream; retry it",
                                  "service_unavailable", code=503))
            raise
        except Exception:  # the 200 is sent already: the client can only hear it in the stream
            logger.exception("streaming response %s failed", response_id)
            yield _sse(error_body("internal server error", "server_error", code=500))
        yield "data: [DONE]\n\n"

    def opening_chunks(self, num_prompts: int) -> list[list[dict]]:
        return []

    def full_choice(self, index: int, out: CompletionOutput, prompt, final: RequestOutput) -> dict:
        raise NotImplementedError

    def delta_choice(self, index: int, out: CompletionOutput, prompt, first: bool,
                     prompt_logprobs: PromptLogprobs | None) -> dict:
        """A chunk's choice from a DELTA output; first: this choice's first chunk."""
        raise NotImplementedError


class _CompletionFormat(_Format):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, api: _Api, body) -> None:
        super().__init__(api, body)
        self.chars_sent: dict[int, int] = {}  # per choice, for the logprobs' text offsets

    def full_choice(self, index, out, prompt, final) -> dict:
        echo = self.body.echo
        text = self._echo_text(prompt) + out.text if echo else out.text
        logprobs = self._logprobs(out, final.prompt_logprobs if echo else None, prompt[1], 0)
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                "prompt_logprobs": _prompt_logprobs_json(final.prompt_logprobs)
                if self.body.prompt_logprobs is not None else None}

    def delta_choice(self, index, out, prompt, first, prompt_logprobs) -> dict:
        echo = first and self.body.echo
        text = self._echo_text(prompt) + out.text if echo else out.text
        logprobs = self._logprobs(out, prompt_logprobs if echo else None, prompt[1],
                                  self.chars_sent.get(index, 0))
        self.chars_sent[index] = self.chars_sent.get(index, 0) + len(text)
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}

    def _echo_text(self, prompt) -> str:
        text, token_ids = prompt
        if text is None:  # given as token ids
            text = self.api.processor.tokenizer.decode(token_ids, skip_special_tokens=False)
        return text

    def _logprobs(self, out: CompletionOutput, prompt_entries: PromptLogprobs | None,
                  prompt_ids: list[int], offset: int) -> dict | None:
        """OpenAI's legacy logprobs: tokens, their logprobs, the top ones and text offsets; with
        echo, the prompt's tokens first (the first has no logprob: null)."""
        if out.logprobs is None:
            return None
        tokens, token_logprobs, tops = [], [], []
        top_n = self.body.logprobs or 0

        def add(token_id: int, entry: dict[int, Logprob] | None) -> None:
            if entry is None:
                tokens.append(self.token_text(token_id))
                token_logprobs.append(None)
                tops.append(None)
                return
            chosen = entry[token_id]
            tokens.append(self.token_text(token_id, chosen))
            token_logprobs.append(chosen.logprob)
            tops.append({self.token_text(tid, lp): lp.logprob for tid, lp in entry.items()
                         if tid != token_id or lp.rank <= top_n})

        for token_id, entry in zip(prompt_ids if prompt_entries is not None else (), prompt_entries or ()):
            add(token_id, entry)
        for token_id, entry in zip(out.token_ids, out.logprobs):
            add(token_id, entry)
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}


class _ChatFormat(_Format):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, api: _Api, body, constraint: OutputConstraint) -> None:
        super().__init__(api, body)
        self.constraint = constraint
        self._readers: dict[int, ToolCallReader | None] = {}  # by choice index

    def _reader(self, index: int) -> ToolCallReader | None:
        """The choice's tool-call reader (None: its text is all content)."""
        if index not in self._readers:
            parser = self.constraint.new_parser()
            self._readers[index] = parser and ToolCallReader(self.constraint, parser)
        return self._readers[index]

    def opening_chunks(self, num_prompts: int) -> list[list[dict]]:
        return [[{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for j in range(self.n)]]

    def full_choice(self, index, out, prompt, final) -> dict:
        reader = self._reader(index)
        if reader is None:
            message, finish_reason = {"role": "assistant", "content": out.text}, out.finish_reason
        else:
            message, finish_reason = reader.message(out.text, out.finish_reason)
        return {"index": index, "message": message, "logprobs": self._logprobs(out),
                "finish_reason": finish_reason, "stop_reason": out.stop_reason}

    def finish_response(self, response: dict, finals: list[RequestOutput]) -> dict:
        response["prompt_logprobs"] = _prompt_logprobs_json(finals[0].prompt_logprobs) \
            if self.body.prompt_logprobs is not None else None
        return response

    def delta_choice(self, index, out, prompt, first, prompt_logprobs) -> dict:
        reader = self._reader(index)
        if reader is None:
            fields, finish_reason = {"content": out.text} if out.text else {}, out.finish_reason
        else:
            fields, finish_reason = reader.delta(out.text, out.finish_reason)
        return {"index": index, "delta": fields, "logprobs": self._logprobs(out),
                "finish_reason": finish_reason}

    def _logprobs(self, out: CompletionOutput) -> dict | None:
        if out.logprobs is None:
            return None
        top_n = self.body.top_logprobs or 0
        content = []
        for token_id, entry in zip(out.token_ids, out.logprobs):
            top = sorted(((tid, lp) for tid, lp in entry.items() if tid != token_id or lp.rank <= top_n),
                         key=lambda item: item[1].rank)[:top_n]
            content.append({**self._token_json(token_id, entry[token_id]),
                            "top_logprobs": [self._token_json(tid, lp) for tid, lp in top]})
        return {"content": content}

    def _token_json(self, token_id: int, lp: Logprob) -> dict:
        text = self.token_text(token_id, lp)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}
