"""The OpenAI-compatible HTTP API over one AsyncEngine: the routes and what wraps them (the
guard, CORS, error handlers). The handlers are server/api.py's, the answers' shapes
server/formats.py's."""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from pagedllm import __version__
from pagedllm.server import anthropic, embeddings, rerank, responses, responses_stream, sagemaker
from pagedllm.server.answer_options import AnswerOptions
from pagedllm.server.api import Api
from pagedllm.server.async_engine import AsyncEngine
from pagedllm.server.dashboard import dashboard_router, engine_snapshot_fn
from pagedllm.server.errors import error_response, install_error_handlers
from pagedllm.server.guard import Guard
from pagedllm.server.limits import InputWorkers, RequestPrecheck
from pagedllm.server.load import LoadTracker, ServerLoad
from pagedllm.server.lora_modules import LoRAModules
from pagedllm.server.lora_routes import lora_router
from pagedllm.server.metrics import ServerMetrics
from pagedllm.server.protocol import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    APIError,
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from pagedllm.server.root_path import RootPath
from pagedllm.server.tokenizer_info import tokenizer_info

# What /openapi.json documents, so that clients (and the fuzz test) know every answer there is.
_ERROR = {"model": ErrorResponse}
_V1_ERRORS = {401: {**_ERROR, "description": "Missing or wrong API key"},
              408: {**_ERROR, "description": "The request body did not arrive in time"},
              413: {**_ERROR, "description": "Request body too large"},
              421: {**_ERROR, "description": "A Host this server does not answer for"}}
_GENERATE_RESPONSES = {
    200: {"description": "The completion, or with stream=true server-sent events",
          "content": {"application/json": {}, "text/event-stream": {}}},
    400: {**_ERROR, "description": "Invalid request"},
    404: {**_ERROR, "description": "No such model"},
    500: {**_ERROR, "description": "The engine failed while running the request"},
    503: {**_ERROR, "description": "Overloaded (too many waiting requests) or engine dead; "
                                   "see Retry-After"},
    **_V1_ERRORS,
}
_POOLING_RESPONSES = {k: v for k, v in _GENERATE_RESPONSES.items() if k != 200}
_TOKENIZE_RESPONSES = {400: {**_ERROR, "description": "Invalid request"},
                       404: {**_ERROR, "description": "No such model"}, **_V1_ERRORS}


@dataclass(frozen=True)
class Cors:
    """Cross-origin access for browsers (vLLM's flags: --allowed-origins, --allowed-methods,
    --allowed-headers, --allow-credentials). No Cors, no CORS headers: browsers on other origins
    are refused, as without a CORS layer at all."""

    allowed_origins: tuple[str, ...]
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, chat_template: str | None = None,
              cors: Cors | None = None, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
              allowed_hosts: tuple[str, ...] | None = None,
              reasoning_parser: str | None = None, options: AnswerOptions = AnswerOptions(),
              root_path: str = "", enable_tokenizer_info_endpoint: bool = False) -> FastAPI:
    """The app over engine. chat_template: replaces the model's for every chat request;
    allowed_hosts: the Host names answered (pagedllm.server.hosts; None: any); reasoning_parser:
    splits chat answers into reasoning and content (pagedllm.text.reasoning); options: how
    answers are written (server/answer_options.py); root_path: the path prefix a proxy serves
    this app under (its routes answer with and without it, as vLLM's --root-path)."""
    metrics = ServerMetrics(lambda: engine.stats, engine.core.config.enable_prefix_caching,
                            engine.ready.max_model_len, engine.ready.max_concurrency)
    engine.on_finished = metrics.observe_finished
    engine.on_added = metrics.observe_added
    engine.on_report = lambda report: metrics.observe_report(report, engine.output_processor.__contains__)
    metrics.count_engine_requests(lambda: engine.num_failed_requests, lambda: engine.num_rejected_requests)
    workers = InputWorkers()
    loras = lora_modules(engine)
    api = Api(engine, model_name, chat_template, workers, reasoning_parser, loras, options)
    stored_responses = responses.ResponseStore()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            workers.close()
            await engine.stop()

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    install_error_handlers(app)
    server_load = ServerLoad()  # added first, so inside the guard: a request it refuses is no load
    app.add_middleware(LoadTracker, load=server_load, stats_fn=lambda: engine.stats)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes,
                       body_timeout_s=body_timeout_s,
                       precheck=RequestPrecheck(engine.input_processor, workers),
                       allowed_hosts=allowed_hosts)
    if cors is not None:  # added last, so outermost: it answers preflights before the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                           allow_methods=list(cors.allowed_methods),
                           allow_headers=list(cors.allowed_headers),
                           allow_credentials=cors.allow_credentials)
    if root_path:  # outermost: every layer sees the prefix
        app.add_middleware(RootPath, root_path=root_path)

    @app.get("/ping", response_class=Response, include_in_schema=False)  # SageMaker's name for it
    @app.post("/ping", response_class=Response, include_in_schema=False)
    @app.get("/health", response_class=Response, responses={
        200: {"description": "Serving", "content": {}},
        503: {**_ERROR, "description": "The engine is dead (restart the server) or not answering"}})
    async def health():
        if await engine.responsive():
            return Response(status_code=200)
        if engine.healthy:  # alive, but silent past its limit
            return error_response(APIError(f"the engine core has not answered for {engine.stall_s:g} s "
                                           "(stopped or hung)", 503))
        return error_response(APIError(engine.dead_reason or "engine not running", 503))

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/load")
    async def load():
        """vLLM's: the generation requests this server is answering now."""
        return {"server_load": server_load.in_flight}

    @app.get("/metrics", response_class=Response, responses={
        200: {"description": "Prometheus metrics", "content": {CONTENT_TYPE_LATEST: {}}}})
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=_V1_ERRORS)
    async def models():
        return {"object": "list", "data": api.model_cards()}

    @app.post("/v1/completions", responses=_GENERATE_RESPONSES)
    async def completions(body: CompletionRequest, raw: Request):
        return await api.completions(body, raw)

    @app.post("/v1/chat/completions", responses=_GENERATE_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await api.chat(body, raw)

    @app.post("/v1/chat/completions/batch", responses=_GENERATE_RESPONSES)
    async def chat_completions_batch(body: BatchChatCompletionRequest, raw: Request):
        return await api.chat_batch(body, raw)

    # Not in /openapi.json: each body it takes is one of the endpoints' there, answered by it.
    @app.post("/invocations", include_in_schema=False)
    async def invocations(raw: Request):
        """SageMaker's: the endpoint the body's fields pick answers it (server/sagemaker.py)."""
        return await sagemaker.invoke(api, raw)

    @app.post("/v1/messages", responses=_GENERATE_RESPONSES)
    async def anthropic_messages(body: anthropic.MessagesRequest, raw: Request):
        return await anthropic.messages(api, raw, body)

    @app.post("/v1/responses", responses=_GENERATE_RESPONSES)
    async def create_response(body: responses.ResponsesRequest, raw: Request):
        return await responses_stream.respond(api, raw, body, stored_responses)

    @app.get("/v1/responses/{response_id}", responses=_TOKENIZE_RESPONSES)
    async def get_response(response_id: str):
        return stored_responses.response(response_id)

    # A pooling engine's (--runner pooling): server/embeddings.py, server/rerank.py.
    @app.post("/v1/embeddings", responses=_POOLING_RESPONSES)
    async def create_embeddings(body: embeddings.EmbeddingRequest, raw: Request):
        return await embeddings.embeddings(api, raw, body)

    @app.post("/pooling", responses=_POOLING_RESPONSES)
    async def create_pooling(body: embeddings.PoolingRequest, raw: Request):
        return await embeddings.pooling(api, raw, body)

    @app.post("/v1/rerank", responses=_POOLING_RESPONSES)
    @app.post("/v2/rerank", responses=_POOLING_RESPONSES)
    @app.post("/rerank", responses=_POOLING_RESPONSES)
    async def create_rerank(body: rerank.RerankRequest, raw: Request):
        return await rerank.rerank(api, raw, body)

    @app.post("/v1/score", responses=_POOLING_RESPONSES)
    @app.post("/score", responses=_POOLING_RESPONSES)
    async def create_score(body: rerank.ScoreRequest, raw: Request):
        return await rerank.score(api, raw, body)

    @app.post("/tokenize", responses=_TOKENIZE_RESPONSES)
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest):
        return await workers.run(api.tokenize, body)

    @app.post("/detokenize", responses=_TOKENIZE_RESPONSES)
    async def detokenize(body: DetokenizeRequest):
        return await workers.run(api.detokenize, body)

    if loras is not None and engine.core.config.allow_runtime_lora_updating:
        app.include_router(lora_router(loras, engine, model_name), responses=_TOKENIZE_RESPONSES)
    if enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info", responses=_V1_ERRORS)
        async def get_tokenizer_info():
            return tokenizer_info(api.processor.tokenizer, chat_template, api.max_model_len)

    app.include_router(dashboard_router(engine_snapshot_fn(engine)))
    return app


def lora_modules(engine: AsyncEngine) -> LoRAModules | None:
    """The LoRA adapters to offer (--enable-lora: --lora-modules', which the core checked at its
    start), or None."""
    config = engine.core.config
    return LoRAModules(config.lora_modules) if config.enable_lora else None
