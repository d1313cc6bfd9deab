"""vLLM's --root-path: the path prefix a proxy serves the API under (`/llm`). Every request's
scope names it, so that routing (Starlette strips it from a path that starts with it), the guard
(server/guard.py reads the path without it) and /openapi.json (its `servers`) agree: a route
answers at /v1/... and at /llm/v1/..., behind the same API key."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class RootPath:
    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)
