"""What a load balancer asks a server about its load, in vLLM's shapes: /load (the generation
requests being answered now) and ORCA's `endpoint-load-metrics` response header, sent when a
request asks for it with `endpoint-load-metrics-format: text` or `json` (the format Envoy and
the Gateway API inference extension read)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from starlette.datastructures import Headers, MutableHeaders
from starlette.routing import get_route_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.engine.messages import EngineCoreStats

# The requests /load counts, and that may carry the ORCA header (vLLM's: the model-running ones).
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch",
                              "/v1/responses", "/v1/messages", "/v1/embeddings", "/v1/rerank",
                              "/v2/rerank", "/rerank", "/v1/score", "/score", "/pooling", "/invocations"})
ORCA_FORMAT_HEADER = "endpoint-load-metrics-format"
ORCA_HEADER = "endpoint-load-metrics"


def orca_header(metrics_format: str, stats: EngineCoreStats) -> str | None:
    """The header's value for format "text" or "json" (any case); None for any other format."""
    named = {"kv_cache_usage_perc": float(stats.kv.usage), "num_requests_waiting": float(stats.num_waiting)}
    kind = metrics_format.strip().lower()
    if kind == "text":
        return "TEXT " + ", ".join(f"named_metrics.{name}={value}" for name, value in named.items())
    if kind == "json":
        return "JSON " + json.dumps({"named_metrics": named})
    return None


@dataclass
class ServerLoad:
    in_flight: int = 0  # generation requests whose answers have not ended


class LoadTracker:
    """Plain ASGI around the app: counts the generation requests in flight (a stream counts until
    its last event is sent) and adds the ORCA header to their answers when asked."""

    def __init__(self, app: ASGIApp, load: ServerLoad, stats_fn: Callable[[], EngineCoreStats]) -> None:
        self.app = app
        self.load = load
        self.stats_fn = stats_fn

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" \
                or get_route_path(scope) not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        metrics_format = Headers(scope=scope).get(ORCA_FORMAT_HEADER)

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start" and metrics_format:
                value = orca_header(metrics_format, self.stats_fn())
                if value is not None:
                    MutableHeaders(scope=message).append(ORCA_HEADER, value)
            await send(message)

        self.load.in_flight += 1
        try:
            await self.app(scope, receive, send_with_header)
        finally:
            self.load.in_flight -= 1
