"""What the API shapes translated onto the chat path share (server/anthropic.py's Messages,
server/responses.py's Responses): the chat body their fields make, checked as a chat body is, and
the chat stream read back as its chunks."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from pagedllm.server.protocol import APIError, ChatCompletionRequest


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat body of fields (None values left out); a 400 naming the first bad field."""
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error.get("loc", ()))
        raise APIError(f"invalid request: {where}: {error.get('msg')}", param=where or None) from None


async def chat_chunks(body: AsyncIterator) -> AsyncIterator[dict]:
    """Each chunk of a chat completions SSE stream, decoded ({"error": ...} for an error event,
    after which the stream ends); [DONE] left out."""
    async for raw in body:
        # SSE ends lines at \n only; str.splitlines would also break at U+2028 and the like.
        for line in (raw.decode() if isinstance(raw, bytes) else raw).split("\n"):
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line.removeprefix("data: "))
