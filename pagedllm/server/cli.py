"""`pagedllm serve`: load the engine, then serve the OpenAI-compatible API with uvicorn."""

from __future__ import annotations

import argparse
import logging

from pagedllm.cli import add_engine_args, engine_config_from_args
from pagedllm.default_model import DEFAULT_MODEL_NAME
from pagedllm.server.protocol import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING_REQUESTS

logger = logging.getLogger(__name__)


def register(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default loopback only; 0.0.0.0 exposes it)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1/* and on the live data of "
                            "the dashboard at / (the page asks for it)")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help=f"larger request bodies get 413 (default {DEFAULT_MAX_BODY_BYTES // 2**20} MiB)")
    serve.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                       help="requests past this many waiting for the engine get a fast 503 with "
                            f"Retry-After (default {DEFAULT_MAX_WAITING_REQUESTS})")
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedllm.engine import LLMEngine
    from pagedllm.server.app import build_app
    from pagedllm.server.async_engine import AsyncEngine

    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be positive; got {args.max_body_bytes}")
    async_engine_args = dict(max_waiting_requests=args.max_waiting_requests)
    AsyncEngine.check_args(**async_engine_args)  # before the minutes a model load may take
    engine = LLMEngine(engine_config_from_args(args))
    name = args.served_model_name or (args.model or DEFAULT_MODEL_NAME)
    app = build_app(AsyncEngine(engine, **async_engine_args), name, api_key=args.api_key,
                    max_body_bytes=args.max_body_bytes)
    # uvicorn handles SIGINT/SIGTERM: it stops accepting, lets in-flight responses finish
    # (bounded by the timeout), then runs the app's shutdown, which stops the engine thread.
    uvicorn.run(app, host=args.host, port=args.port, log_level="info",
                timeout_graceful_shutdown=30)
    return 0
