"""The OpenAI-compatible HTTP API over one AsyncEngine."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import reprlib
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm import __version__
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestFailed
from pagedllm.server.dashboard import EVENTS_PATH, dashboard_router, engine_snapshot_fn
from pagedllm.server.metrics import ServerMetrics
from pagedllm.server.protocol import (
    MAX_PROMPTS_PER_REQUEST,
    MAX_STOP_TOKEN_IDS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    error_body,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 2**20

# What /openapi.json documents, so that clients (and the fuzz test) know every answer there is.
_ERROR = {"model": ErrorResponse}
_V1_ERRORS = {401: {**_ERROR, "description": "Missing or wrong API key"},
              413: {**_ERROR, "description": "Request body too large"}}
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


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    metrics = ServerMetrics(lambda: engine.snapshot)
    engine.on_finished = metrics.observe_finished
    api = _Api(engine, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    _install_error_handlers(app)
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)

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
    """The API key (on /v1/* and the dashboard's events) and the body-size limit, checked before
    any endpoint runs.

    Plain ASGI rather than an http middleware, so that it can count a body sent in chunks
    (no Content-Length) as it arrives and refuse it past the limit without buffering more."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected_auth = f"Bearer {api_key}".encode() if api_key is not None else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self.expected_auth is not None and scope["path"].startswith(("/v1/", EVENTS_PATH)):
            given = headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, self.expected_auth):  # constant time
                await _error(APIError("invalid or missing API key: send 'Authorization: Bearer "
                                      "<key>'", 401))(scope, receive, send)
                return
        length = headers.get("content-length")
        if length is not None:
            # The HTTP server already holds the body to its declared length.
            if length.isdigit() and int(length) > self.max_body_bytes:
                await self._too_large(f"{length} bytes")(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        if scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        body = await self._read_limited(receive)
        if body is None:
            await self._too_large("larger (sent in chunks, without Content-Length)")(scope, receive, send)
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


def _error(exc: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status_code == 503 else None
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
    """The endpoint logic: turn OpenAI bodies into engine requests and outputs into responses."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.vocab_size = engine.engine.model_config.vocab_size
        # Tokenizing holds the GIL (and so the event loop): a 4 MiB prompt takes seconds. No
        # text longer than this can fit in max_model_len tokens, so it is refused untokenized.
        self.max_prompt_chars = self.max_model_len * _longest_token_chars(self.tokenizer)

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "pagedllm",
                "max_model_len": self.max_model_len}

    # -- endpoints -----------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, raw: Request):
        self._check_common(body)
        prompts = self._completion_prompts(body.prompt)
        if body.logprobs is not None and not 0 <= body.logprobs <= 20:
            raise APIError(f"logprobs must be an integer in [0, 20]; got {body.logprobs}", param="logprobs")
        params = [self._sampling_params(body, ids, body.max_tokens, body.logprobs) for _, ids in prompts]
        return await self._respond(body, raw, "cmpl", prompts, params, _CompletionFormat(self, body))

    async def chat(self, body: ChatCompletionRequest, raw: Request):
        self._check_common(body)
        if not body.messages:
            raise APIError("messages is empty: send at least one message", param="messages")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
            raise APIError(f"top_logprobs must be an integer in [0, 20]; got {body.top_logprobs}",
                           param="top_logprobs")
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt)
        except ValueError as exc:
            raise APIError(str(exc), param="messages") from exc
        except Exception as exc:  # the template itself raised (e.g. roles out of order)
            raise APIError(f"the chat template could not render these messages: {exc}",
                           param="messages") from exc
        ids = self._encode(text, "messages", add_special_tokens=False)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = [self._sampling_params(body, ids, max_tokens, logprobs)]
        return await self._respond(body, raw, "chatcmpl", [(text, ids)], params, _ChatFormat(self, body))

    # -- checks --------------------------------------------------------------------------------
    def _check_common(self, body) -> None:
        if body.model is not None and body.model != self.model_name:
            raise APIError(f"model {body.model!r} does not exist; this server serves "
                           f"{self.model_name!r}", 404, param="model", code="model_not_found")
        if body.stream_options is not None and not body.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")
        if body.logit_bias:
            raise APIError("logit_bias is not supported", param="logit_bias")
        if isinstance(body.stop, list) and len(body.stop) > 16:
            raise APIError("stop may list at most 16 strings", param="stop")
        if body.stop_token_ids is not None and len(body.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise APIError(f"stop_token_ids may list at most {MAX_STOP_TOKEN_IDS} ids; got "
                           f"{len(body.stop_token_ids)}", param="stop_token_ids")

    def _completion_prompts(self, prompt) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError("prompt is empty: send a string, a list of strings or token ids", param="prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        if len(prompt) > MAX_PROMPTS_PER_REQUEST:
            raise APIError(f"prompt may list at most {MAX_PROMPTS_PER_REQUEST} prompts; got "
                           f"{len(prompt)}", param="prompt")
        result = []
        for p in prompt:
            if isinstance(p, str):
                if not p:
                    raise APIError("prompt is empty: send at least one character", param="prompt")
                result.append((p, self._encode(p, "prompt")))
            else:
                self._check_token_ids(p)
                result.append((None, list(p)))
        return result

    def _encode(self, text: str, param: str, **kwargs) -> list[int]:
        if len(text) > self.max_prompt_chars:
            raise APIError(f"the prompt is {len(text)} characters, more than this model's maximum "
                           f"context length of {self.max_model_len} tokens can hold (at most "
                           f"{self.max_prompt_chars} characters): shorten it", param=param)
        return self.tokenizer.encode(text, **kwargs)

    def _check_token_ids(self, ids: list[int]) -> None:
        if not ids:
            raise APIError("prompt is empty: send at least one token id", param="prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(f"prompt token ids out of vocabulary (0 to {self.vocab_size - 1}): "
                           f"{bad[:5]}", param="prompt")

    def _sampling_params(self, body, prompt_ids: list[int], max_tokens: int | None,
                         logprobs: int | None) -> SamplingParams:
        room = self.max_model_len - len(prompt_ids)
        if room <= 0:
            raise APIError(f"this model's maximum context length is {self.max_model_len} tokens and "
                           f"your prompt has {len(prompt_ids)}: shorten it", param="prompt")
        if max_tokens is not None and max_tokens > room:
            raise APIError(f"'max_tokens' is too large: {max_tokens}. This model's maximum context "
                           f"length is {self.max_model_len} tokens and your request has "
                           f"{len(prompt_ids)} input tokens ({max_tokens} + {len(prompt_ids)} > "
                           f"{self.max_model_len})", param="max_tokens")
        bad_stop_ids = [t for t in body.stop_token_ids or [] if not 0 <= t < self.vocab_size]
        if bad_stop_ids:
            raise APIError(f"stop_token_ids out of vocabulary: {bad_stop_ids[:5]}", param="stop_token_ids")
        fields = dict(
            n=body.n, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k is None else body.top_k, min_p=body.min_p or 0.0,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            seed=body.seed, max_tokens=room if max_tokens is None else max_tokens,
            min_tokens=body.min_tokens, stop=body.stop, stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos, logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output)
        try:
            return SamplingParams(**fields)
        except ValueError as exc:
            raise APIError(str(exc), param=str(exc).split(" ", 1)[0]) from exc

    # -- running -------------------------------------------------------------------------------
    async def _respond(self, body, raw: Request, prefix: str, prompts, params, fmt):
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        streams = await self._start(response_id, body, prompts, params)
        if body.stream:
            return StreamingResponse(fmt.stream(response_id, streams, prompts),
                                     media_type="text/event-stream")
        finals = await _collect_or_abort(streams, raw)
        return fmt.full(response_id, finals, prompts)

    async def _start(self, response_id: str, body, prompts, params) -> list[AsyncIterator]:
        streams = []
        try:
            self.engine.check_room(len(prompts))  # all or none of a request's prompts
            for i, ((text, ids), p) in enumerate(zip(prompts, params)):
                prompt = {"prompt_token_ids": ids, "prompt": text}
                streams.append(await self.engine.generate(f"{response_id}-{i}", prompt, p, body.cache_salt))
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


def _longest_token_chars(tokenizer) -> int:
    """An upper bound on the characters one token stands for: the longest vocabulary entry (in
    byte-level and metaspace vocabularies an entry is at least as long as the text it decodes
    to). Without a vocabulary to look at, no bound."""
    try:
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        return max(len(token) for token in vocab)
    except Exception:  # another kind of tokenizer: always tokenize
        return 2**40


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
            await asyncio.gather(*tasks, return_exceptions=True)
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


class _Format:
    """Shared by both endpoints: choice bookkeeping, usage and the streaming loop."""

    object_full = ""
    object_chunk = ""

    def __init__(self, api: _Api, body) -> None:
        self.api = api
        self.body = body
        self.n = body.n

    def usage(self, prompts, outputs_token_counts: int) -> dict:
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": outputs_token_counts,
                "total_tokens": prompt_tokens + outputs_token_counts}

    def full(self, response_id: str, finals: list[RequestOutput], prompts) -> dict:
        choices, generated = [], 0
        for i, final in enumerate(finals):
            for out in final.outputs:
                choices.append(self.full_choice(i * self.n + out.index, out, prompts[i]))
                generated += len(out.token_ids)
        return {"id": response_id, "object": self.object_full, "created": int(time.time()),
                "model": self.api.model_name, "choices": choices,
                "usage": self.usage(prompts, generated)}

    async def stream(self, response_id: str, streams, prompts) -> AsyncIterator[str]:
        created = int(time.time())
        sent_chars: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        generated: dict[int, int] = {}
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)

        def chunk(choices: list[dict]) -> str:
            return _sse({"id": response_id, "object": self.object_chunk, "created": created,
                         "model": self.api.model_name, "choices": choices})

        try:
            for first in self.opening_chunks(len(prompts)):
                yield chunk(first)
            async for i, output in _merge(streams):
                choices = []
                for out in output.outputs:
                    index = i * self.n + out.index
                    start_c, start_t = sent_chars.get(index, 0), sent_tokens.get(index, 0)
                    delta = out.text[start_c:]
                    if not delta and out.finish_reason is None:
                        continue
                    sent_chars[index], sent_tokens[index] = len(out.text), len(out.token_ids)
                    generated[index] = len(out.token_ids)
                    prefix = prompts[i][0] or "" if start_c == 0 and getattr(self.body, "echo", False) else ""
                    choices.append(self.delta_choice(index, prefix + delta, out, start_t))
                if choices:
                    yield chunk(choices)
            if include_usage:
                yield _sse({"id": response_id, "object": self.object_chunk, "created": created,
                            "model": self.api.model_name, "choices": [],
                            "usage": self.usage(prompts, sum(generated.values()))})
        except (RequestFailed, EngineDeadError) as exc:
            yield _sse(error_body(str(exc), "server_error", code=500))
        except Exception:  # the 200 is sent already: the client can only hear it in the stream
            logger.exception("streaming response %s failed", response_id)
            yield _sse(error_body("internal server error", "server_error", code=500))
        yield "data: [DONE]\n\n"

    def opening_chunks(self, num_prompts: int) -> list[list[dict]]:
        return []

    def full_choice(self, index: int, out: CompletionOutput, prompt) -> dict:
        raise NotImplementedError

    def delta_choice(self, index: int, delta: str, out: CompletionOutput, first_token: int) -> dict:
        raise NotImplementedError


class _CompletionFormat(_Format):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def full_choice(self, index, out, prompt) -> dict:
        text = (prompt[0] or "") + out.text if self.body.echo else out.text
        return {"index": index, "text": text, "logprobs": self._logprobs(out, 0),
                "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}

    def delta_choice(self, index, delta, out, first_token) -> dict:
        return {"index": index, "text": delta, "logprobs": self._logprobs(out, first_token),
                "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}

    def _logprobs(self, out: CompletionOutput, start: int) -> dict | None:
        if out.logprobs is None:
            return None
        tokens, token_logprobs, tops = [], [], []
        for token_id, entry in zip(out.token_ids[start:], out.logprobs[start:]):
            chosen = entry[token_id]
            tokens.append(chosen.decoded_token)
            token_logprobs.append(chosen.logprob)
            tops.append({lp.decoded_token: lp.logprob for tid, lp in entry.items()
                         if tid != token_id or lp.rank <= (self.body.logprobs or 0)})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": []}


class _ChatFormat(_Format):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def opening_chunks(self, num_prompts: int) -> list[list[dict]]:
        return [[{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for j in range(self.n)]]

    def full_choice(self, index, out, prompt) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": out.text},
                "logprobs": self._logprobs(out, 0), "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason}

    def delta_choice(self, index, delta, out, first_token) -> dict:
        return {"index": index, "delta": {"content": delta} if delta else {},
                "logprobs": self._logprobs(out, first_token), "finish_reason": out.finish_reason}

    def _logprobs(self, out: CompletionOutput, start: int) -> dict | None:
        if out.logprobs is None:
            return None
        top_n = self.body.top_logprobs or 0
        content = []
        for token_id, entry in zip(out.token_ids[start:], out.logprobs[start:]):
            chosen = entry[token_id]
            top = sorted((lp for tid, lp in entry.items() if tid != token_id or lp.rank <= top_n),
                         key=lambda lp: lp.rank)[:top_n]
            content.append({"token": chosen.decoded_token, "logprob": chosen.logprob,
                            "bytes": list(chosen.decoded_token.encode()),
                            "top_logprobs": [{"token": lp.decoded_token, "logprob": lp.logprob,
                                              "bytes": list(lp.decoded_token.encode())} for lp in top]})
        return {"content": content}
