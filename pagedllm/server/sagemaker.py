"""SageMaker's hosting route, as vLLM serves it: POST /invocations, one path for every request,
the body's fields saying which endpoint answers it (the first of INVOCATIONS whose fields it has),
with that endpoint's answer, errors and streaming. Its health check, /ping, is /health (app.py)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from pagedllm.server import embeddings, rerank
from pagedllm.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

Handler = Callable[[Any, Request, Any], Awaitable[Any]]

# (the fields that pick it, its body, its handler), tried in this order.
INVOCATIONS: tuple[tuple[tuple[str, ...], type[BaseModel], Handler], ...] = (
    (("messages",), ChatCompletionRequest, lambda api, raw, body: api.chat(body, raw)),
    (("prompt",), CompletionRequest, lambda api, raw, body: api.completions(body, raw)),
    (("input",), embeddings.EmbeddingRequest, embeddings.embeddings),
    (("query", "documents"), rerank.RerankRequest, rerank.rerank),
    (("text_1", "text_2"), rerank.ScoreRequest, rerank.score),
)


async def invoke(api, raw: Request):
    """The answer of the endpoint the body's fields pick; a 400 naming the fields if none does."""
    try:
        body = json.loads(await raw.body())
    except ValueError as exc:
        raise APIError(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise APIError("the body must be a JSON object")
    for fields, model, handler in INVOCATIONS:
        if all(name in body for name in fields):
            try:
                request = model.model_validate(body)
            except ValidationError as exc:  # told as the endpoint itself tells it
                raise RequestValidationError(exc.errors()) from exc
            return await handler(api, raw, request)
    known = "; ".join(f"{' and '.join(fields)} ({model.__name__})" for fields, model, _ in INVOCATIONS)
    raise APIError(f"/invocations takes the body of one of: {known}; this body has none of those fields")
