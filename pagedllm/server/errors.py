"""Errors in OpenAI's shape: the exception handlers, and a validation error told as one line
naming the field (the most specific of pydantic's errors, the parameter in `param`). Each problem
ends with pydantic's error type in brackets (`[greater_than_equal]`), and `code` is the first
one's: vLLM's messages are pydantic's own, and clients switching from vLLM match on those types."""

from __future__ import annotations

import logging
import reprlib

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.server.protocol import (
    APIError,
)

logger = logging.getLogger(__name__)

def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        return error_response(APIError(_describe_validation(exc), 400, param=_first_param(exc),
                                       code=_first_type(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        return error_response(APIError(str(exc.detail), exc.status_code))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception):
        logger.exception("unexpected error")
        return error_response(APIError("internal server error", 500, error_type="server_error"))


def error_response(exc: APIError, close: bool = False) -> JSONResponse:
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
        problem += f" [{err.get('type', 'invalid')}]"
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


def _first_type(exc: RequestValidationError) -> str | None:
    """pydantic's type of the error the message names first (greater_than_equal, int_type, ...)."""
    specific = _most_specific(exc.errors())
    return str(specific[0].get("type")) if specific else None


def _first_param(exc: RequestValidationError) -> str | None:
    for err in exc.errors():
        if err.get("type") == "json_invalid":  # its location is a character offset
            continue
        path = _field_path(err)
        if path:
            return path[0]
    return None


_CLIENT_STRING = reprlib.Repr()
_CLIENT_STRING.maxstring = _CLIENT_STRING.maxother = 100


def short_repr(value) -> str:
    """A client's value, quoted and cut to about 100 characters, for an error message."""
    return _CLIENT_STRING.repr(value)
