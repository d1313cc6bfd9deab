"""OpenAI's /v1/embeddings over a pooling engine (--runner pooling): one input or a list of them
(texts or token ids), each one pooling request (pagedllm.pooling_params); `dimensions` cuts each
vector (then it is normalized), `encoding_format` base64 sends the float32 bytes (little-endian)
as the official client asks by default. A generation engine answers 400, as a pooling engine does
to completions (the input processor's rule). vLLM's /pooling takes the same inputs and gives what
the model pools: a classifier's (reward model's) raw head logits, else the embedding."""

from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Annotated, Literal

from fastapi import Request
from pydantic import Field

from pagedllm.engine.input_processor import InvalidInput, PromptInput
from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.server.protocol import APIError, Bool, Int, Text, TokenId, _Body
from pagedllm.server.streams import collect_or_abort

# OpenAI's bound on the inputs of one request.
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(_Body):
    model: Text | None = None
    input: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None
    user: Text | None = None  # accepted and ignored, as on the other endpoints
    # extras (vLLM's): whether to scale to unit length (null: the engine's --pooling-normalize);
    # whether a text input gets the tokenizer's BOS/EOS
    normalize: Bool | None = None
    add_special_tokens: Bool = True
    # pagedllm's: text put before each text input as it is (an embedder's query prefix)
    instruction: Annotated[str, Field(min_length=1)] | None = None


class PoolingRequest(_Body):
    """vLLM's /pooling."""

    model: Text | None = None
    input: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    add_special_tokens: Bool = True


def embedding_inputs(value) -> list[PromptInput]:
    """The body's input as a list of prompts (a list of ints is one prompt of token ids)."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError("input must not be empty", param="input")
    if isinstance(value[0], int):
        return [value]
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise APIError(f"input lists {len(value)} inputs; at most {MAX_EMBEDDING_INPUTS} are accepted in "
                       "one request", param="input")
    return list(value)


def check_request(api, body, response_id: str) -> None:
    """The model field (the base model: a LoRA adapter changes generation only, and pooling runs
    without one) and the fields no body declares."""
    if api._check_model(body) is not None:
        raise APIError(f"model {body.model!r} is a LoRA adapter; embeddings and scores come from the "
                       "base model: name it, or leave model out", param="model")
    api.extra_fields.check(body, response_id)


def pooling_params(api, task: str, dimensions: int | None = None,
                   normalize: bool | None = None) -> PoolingParams:
    try:
        return api.processor.pooling_params(task, dimensions, normalize)
    except InvalidInput as exc:
        raise APIError(str(exc), param=exc.param) from exc


def process_pooling(api, response_id: str, prompts: list[PromptInput], params: PoolingParams, param: str,
                    add_special_tokens: bool = True) -> list[tuple[str | None, EngineCoreRequest]]:
    """Each prompt through the input processor (in the input workers: tokenizing); a 400 for more
    prompts than the server ever queues at once (they would get a 503 however long one waits)."""
    limit = api.engine.max_waiting_requests
    if limit is not None and len(prompts) > limit:
        raise APIError(f"this request makes {len(prompts)} prompts; this server queues at most {limit} "
                       "at once (--max-waiting-requests): send fewer per request", param=param)
    try:
        return [api.processor.process_pooling(f"{response_id}-{i}", prompt, params,
                                              add_special_tokens=add_special_tokens)
                for i, prompt in enumerate(prompts)]
    except InvalidInput as exc:
        raise APIError(str(exc), param=param if exc.param == "prompt" else exc.param) from exc


async def run_pooling(api, raw: Request, requests: list[tuple[str | None, EngineCoreRequest]]) -> list:
    """Start every request (all or none) and wait for their PoolingRequestOutputs, in order."""
    outputs = await collect_or_abort(await api._start(requests), raw)
    if not all(isinstance(o, PoolingRequestOutput) for o in outputs):  # ended with no vector
        raise APIError("the engine ended the request before its vector was ready (it is shutting "
                       "down)", 503)
    return outputs


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def embeddings(api, raw: Request, body: EmbeddingRequest) -> dict:
    response_id = f"embd-{uuid.uuid4().hex}"
    check_request(api, body, response_id)
    prompts = embedding_inputs(body.input)
    params = pooling_params(api, "embed", body.dimensions, body.normalize)
    if body.instruction is not None:
        if not all(isinstance(p, str) for p in prompts):
            raise APIError("instruction goes before text inputs; these are token ids", param="instruction")
        prompts = [body.instruction + p for p in prompts]
    requests = await api.workers.run(process_pooling, api, response_id, prompts, params, "input",
                                     body.add_special_tokens)
    outputs = await run_pooling(api, raw, requests)
    return _vectors(api, response_id, outputs, "embedding", body.encoding_format)


def _vectors(api, response_id: str, outputs: list, kind: str, encoding_format: str) -> dict:
    """The answer holding each output's vector: OpenAI's embeddings list (kind "embedding") or
    vLLM's pooling list (kind "pooling", the vector under "data")."""
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    field = "embedding" if kind == "embedding" else "data"
    return {"id": response_id, "object": "list", "created": int(time.time()), "model": api.model_name,
            "data": [{"object": kind, "index": i, field: encode_vector(o.outputs.data, encoding_format)}
                     for i, o in enumerate(outputs)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


async def pooling(api, raw: Request, body: PoolingRequest) -> dict:
    response_id = f"pool-{uuid.uuid4().hex}"
    check_request(api, body, response_id)
    prompts = embedding_inputs(body.input)
    setup = api.processor.pooling
    params = pooling_params(api, "reward" if setup is not None and setup.num_labels else "embed")
    requests = await api.workers.run(process_pooling, api, response_id, prompts, params, "input",
                                     body.add_special_tokens)
    outputs = await run_pooling(api, raw, requests)
    return _vectors(api, response_id, outputs, "pooling", body.encoding_format)
