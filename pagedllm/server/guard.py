"""The guard in front of the routes: API key and host checks, body size and time limits, and the
precheck that measures a body before the schema reads it; a body read here is replayed to the
route."""

from __future__ import annotations

import asyncio
import hmac

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.routing import get_route_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.server.dashboard import EVENTS_PATH
from pagedllm.server.errors import error_response, short_repr
from pagedllm.server.hosts import host_allowed
from pagedllm.server.limits import RequestPrecheck
from pagedllm.server.protocol import (
    DEFAULT_BODY_TIMEOUT_S,
    APIError,
)

# Paths the API key guards (the dashboard's page itself loads without it, and asks for it).
GUARDED_PATHS = ("/v1/", "/v2/", "/tokenize", "/detokenize", "/tokenizer_info", "/rerank", "/score",
                 "/pooling", "/invocations", EVENTS_PATH)
# Bodies measured by RequestPrecheck before the schema reads them.
PRECHECKED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/tokenize",
                    "/detokenize", "/invocations")


class Guard:
    """The Host header (pagedllm.server.hosts), the API key (on GUARDED_PATHS: /v1/*, /v2/*,
    /tokenize, /detokenize, /rerank, /score, /pooling, /invocations and the dashboard's events), the
    body's size and time limits, and the cheap bounds on a JSON body (RequestPrecheck), checked
    before any endpoint runs.

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
            host = short_repr(headers.get("host"))
            await error_response(APIError(f"this server does not answer for host {host} "
                                          "(see --allowed-hosts)",
                                          421, code="misdirected_request"))(scope, receive, send)
            return
        path = get_route_path(scope)  # without the --root-path prefix, if the request has it
        if self.expected_auth is not None and path.startswith(GUARDED_PATHS):
            given = headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, self.expected_auth):  # constant time
                await error_response(APIError("invalid or missing API key: send 'Authorization: Bearer "
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
            await error_response(error, close=True)(scope, receive, send)
            return
        if body is None:
            await self._too_large("larger (sent in chunks, without Content-Length)")(scope, receive, send)
            return
        if self.precheck is not None and path in PRECHECKED_PATHS:
            error = await self.precheck.check(body)
            if error is not None:
                await error_response(error)(scope, receive, send)
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
        return error_response(APIError(f"the request body is {size}; the limit is {self.max_body_bytes} "
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
