"""The engine's output streams of one HTTP request: merged, collected, closed, aborted when
the client leaves."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request

from pagedllm.outputs import RequestOutput
from pagedllm.server.async_engine import EngineDeadError, RequestFailed
from pagedllm.server.protocol import (
    APIError,
)


async def close_all(streams) -> None:
    for stream in streams:
        await stream.aclose()


async def last_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for output in stream:
        last = output
    return last


async def collect_or_abort(streams, raw: Request) -> list[RequestOutput]:
    """Wait for every request's final output; abort them all if the client goes away."""
    tasks = [asyncio.ensure_future(last_output(s)) for s in streams]
    gathered = asyncio.ensure_future(asyncio.gather(*tasks))
    watcher = asyncio.ensure_future(wait_disconnect(raw))
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
            await close_all(streams)


async def wait_disconnect(raw: Request) -> None:
    while not await raw.is_disconnected():
        await asyncio.sleep(0.2)


async def merge_streams(streams) -> AsyncIterator[tuple[int, RequestOutput]]:
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
        await close_all(streams)
