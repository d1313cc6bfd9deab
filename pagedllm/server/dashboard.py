"""The KV cache dashboard: a page at / and /dashboard that draws every KV block live, and the
server-sent events that feed it.

Each event is one JSON snapshot: {"time_s", "stats": the engine's figures, "blocks": the block
map (pagedllm/core/kv/snapshot.py)}, a few times a second. The router takes its snapshots from an
async `snapshot_fn`, so it does not care where the engine runs; `engine_snapshot_fn` below is
the one place that knows.

The API key: the page itself is static and holds no data, so it loads without one. Its events
are guarded like /v1/* (the app's guard checks EVENTS_PATH too). EventSource cannot send
headers, so the page reads the event stream with fetch() and sends 'Authorization: Bearer KEY'
like any API client. It asks for the key when the server answers 401 and keeps it in
sessionStorage (this tab only, gone when it closes); a link may carry it in the URL fragment
(http://host:8000/#key=KEY), which browsers never send to a server, so it never reaches an
access log, and the page removes it from the address bar at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from pagedllm.server.async_engine import EngineDeadError
from pagedllm.server.dashboard_page import render_page
from pagedllm.server.protocol import error_body

if TYPE_CHECKING:
    from pagedllm.core.kv.snapshot import BlockMap
    from pagedllm.engine.core import EngineCore
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine.messages import EngineCoreStats
    from pagedllm.server.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

EVENTS_PATH = "/dashboard/events"
DEFAULT_INTERVAL_S = 0.25
# Each event stream ends after this long and the page reconnects at once: uvicorn lets open
# responses finish before it shuts down, so a watching page must never hold a stream for long.
STREAM_LIFETIME_S = 5.0
# Event streams open at once at most; more get a 503 with Retry-After (issue 32, finding 7: 150
# readers, reconnecting every STREAM_LIFETIME_S, stretched another client's token gaps to 1.5 s).
# A page per operator is the use; 16 leaves room for a team.
MAX_EVENT_READERS = 16

SnapshotFn = Callable[[], Awaitable[dict]]


def dashboard_router(snapshot_fn: SnapshotFn, interval_s: float = DEFAULT_INTERVAL_S,
                     stream_lifetime_s: float = STREAM_LIFETIME_S,
                     max_readers: int = MAX_EVENT_READERS) -> APIRouter:
    """The page and its events (at most max_readers streams at once). Guard EVENTS_PATH with the
    API key where the app has one."""
    page = render_page("KV cache", {"mode": "live", "events": EVENTS_PATH})
    latest = _SharedSnapshot(snapshot_fn, max_age_s=interval_s / 2)
    readers = _Readers(max_readers)
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    @router.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @router.get(EVENTS_PATH, include_in_schema=False)
    async def dashboard_events() -> Response:
        if not readers.enter():
            return JSONResponse(
                error_body(f"the dashboard has {readers.limit} event readers already; try again "
                           "later", "service_unavailable"), 503, headers={"Retry-After": "5"})
        return StreamingResponse(readers.counted(_events(latest, interval_s, stream_lifetime_s)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-store"})

    return router


class _Readers:
    """The event streams open now, bounded (counted on the event loop: no lock needed)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0

    def enter(self) -> bool:
        if self.open >= self.limit:
            return False
        self.open += 1
        return True

    async def counted(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """events, the reader counted out when they end or the client leaves."""
        try:
            async for event in events:
                yield event
        finally:
            self.open -= 1


class _SharedSnapshot:
    """The latest snapshot, encoded once, for every page watching: at most one is taken per
    max_age_s however many pages are open, so fifty pages cost the engine what one does."""

    def __init__(self, snapshot_fn: SnapshotFn, max_age_s: float) -> None:
        self.snapshot_fn = snapshot_fn
        self.max_age_s = max_age_s
        self._lock = asyncio.Lock()
        self._event = ""
        self._taken_at = -math.inf

    async def get(self) -> str:
        async with self._lock:
            if time.monotonic() - self._taken_at >= self.max_age_s:
                self._event = _sse(await self.snapshot_fn())
                self._taken_at = time.monotonic()
            return self._event


async def _events(latest: _SharedSnapshot, interval_s: float,
                  lifetime_s: float) -> AsyncIterator[str]:
    deadline = time.monotonic() + lifetime_s
    while True:
        try:
            yield await latest.get()
        except EngineDeadError as exc:
            yield _sse({"error": f"the engine is not running: {exc}"})
            return
        except Exception:  # a bug: say so on the page, keep the details in the log
            logger.exception("dashboard snapshot failed")
            yield _sse({"error": "the dashboard snapshot failed; see the server log"})
            return
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(interval_s)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


# -- where snapshots come from ----------------------------------------------------------------------
# In the server the engine core runs in a process of its own: a snapshot is one request/reply on
# its channel, answered between two steps with the figures and the block map as plain data (the
# block map's bytes cross raw); the payload is built here. The offline benches build the same
# payload from an engine in their own process (core_snapshot).

def engine_snapshot_fn(async_engine: AsyncEngine) -> SnapshotFn:
    async def snapshot() -> dict:
        stats, blocks = await async_engine.snapshot()
        return snapshot_payload(stats, blocks)

    return snapshot


def core_snapshot(core: EngineCore | LLMEngine) -> dict:
    """What the page shows, from a core (or engine) in this process."""
    return snapshot_payload(core.stats(), core.block_map())


def snapshot_payload(stats: EngineCoreStats, blocks: BlockMap) -> dict:
    """The figures and the KV block map as one JSON-ready event."""
    return {"time_s": time.monotonic(), "stats": stats.to_dict(), "blocks": blocks.to_dict()}
