"""Cheap bounds on a raw request, and the worker threads that do a request's expensive work.

A body inside the size limit can still hold 250,000 chat messages or 1.9 million token ids.
Parsing that, validating it with the schema, rendering it through a chat template and tokenizing
it took seconds of the event loop every stream shares, only to refuse it as too long. So:

- RequestPrecheck reads a JSON body in a worker thread, before the schema sees it, and refuses it
  (400) when it is past what any request to this model could use: the input processor's bounds
  (InputProcessor.check_request_size: messages, their text, prompts, token ids) and a bound on
  the number of JSON values in the whole body. What it passes costs the event loop milliseconds
  to parse and validate again.
- InputWorkers runs templates, tokenizing and token-id checks in a few threads. Jinja is Python
  and gives up the GIL every few milliseconds; the tokenizer is asked through encode_batch, which
  releases it (pagedllm.text.tokenizer.Tokenizer.encode). The event loop keeps streaming meanwhile.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec

from pagedllm.engine.input_processor import InputProcessor, InvalidInput
from pagedllm.server.protocol import MAX_PROMPTS_PER_REQUEST, APIError

T = TypeVar("T")

# Threads for a request's expensive input work; more would only share the same cores.
NUM_INPUT_WORKERS = 4
# JSON values any request needs beyond its prompts' token ids and a vocabulary-sized list
# (allowed_token_ids): every other field, message and content part together.
_OTHER_JSON_VALUES = 4096


class InputWorkers:
    """A small pool for blocking input work, so the event loop never runs it."""

    def __init__(self, num_threads: int = NUM_INPUT_WORKERS) -> None:
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="pagedllm-input")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RequestPrecheck:
    """The bounds a raw JSON body must pass before the schema, templates or tokenizer see it."""

    def __init__(self, processor: InputProcessor, workers: InputWorkers) -> None:
        self.processor = processor
        self.workers = workers
        self.max_json_values = (MAX_PROMPTS_PER_REQUEST * processor.max_model_len
                                + processor.vocab_size + _OTHER_JSON_VALUES)

    async def check(self, body: bytes) -> APIError | None:
        """The 400 for a body past a bound, or None (a body that is not JSON is left to the
        schema, which says so)."""
        return await self.workers.run(self._check, body)

    def _check(self, body: bytes) -> APIError | None:
        try:  # msgspec: half json's time holding the GIL (54 -> 25 ms on 5 MiB of token ids)
            decoded = msgspec.json.decode(body)
        except (ValueError, RecursionError):  # msgspec's DecodeError is a ValueError
            return None
        try:  # first: its messages name the field
            self.processor.check_request_size(decoded, MAX_PROMPTS_PER_REQUEST)
        except InvalidInput as exc:
            return APIError(str(exc), param=exc.param)
        if self._too_many_values(decoded):
            return APIError(f"the request body holds more than {self.max_json_values} JSON values, "
                            "more than any request to this model can use")
        return None

    def _too_many_values(self, decoded: Any) -> bool:
        """Whether the body holds more JSON values than max_json_values; stops counting there
        (a container's length is read before its items)."""
        if not isinstance(decoded, (dict, list)):
            return False
        count, pending = 1, [decoded]
        while pending:
            value = pending.pop()
            children = value.values() if isinstance(value, dict) else value
            count += len(children)
            if count > self.max_json_values:
                return True
            pending.extend(child for child in children if isinstance(child, (dict, list)))
        return False
