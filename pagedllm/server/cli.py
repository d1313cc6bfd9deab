"""`pagedllm serve [MODEL]`: load the engine, then serve the OpenAI-compatible API with uvicorn."""

from __future__ import annotations

import argparse
import json
import logging

from pagedllm.cli import add_engine_args, engine_config_from_args
from pagedllm.default_model import DEFAULT_MODEL_NAME
from pagedllm.server.protocol import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING_REQUESTS

logger = logging.getLogger(__name__)


def register(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="HF folder or .gguf file, as `vllm serve MODEL` (or --model)")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default loopback only; 0.0.0.0 exposes it)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize "
                            "and on the live data of the dashboard at / (the page asks for it)")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--chat-template", default=None,
                       help="a Jinja chat template, or a file holding one, for every chat request "
                            "instead of the model's")
    serve.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help=f"larger request bodies get 413 (default {DEFAULT_MAX_BODY_BYTES // 2**20} MiB)")
    serve.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                       help="requests past this many waiting for the engine get a fast 503 with "
                            f"Retry-After (default {DEFAULT_MAX_WAITING_REQUESTS})")
    cors = serve.add_argument_group("CORS (off unless --allowed-origins is given)")
    cors.add_argument("--allowed-origins", type=_string_list, default=None,
                      help='origins browsers may call from: a JSON list (\'["https://a.example"]\', '
                           '\'["*"]\') or comma-separated')
    cors.add_argument("--allowed-methods", type=_string_list, default=["*"])
    cors.add_argument("--allowed-headers", type=_string_list, default=["*"])
    cors.add_argument("--allow-credentials", action="store_true")
    serve.set_defaults(func=cmd_serve)


def _string_list(value: str) -> list[str]:
    """A JSON list of strings (vLLM's form) or comma-separated strings."""
    if value.lstrip().startswith("["):
        try:
            items = json.loads(value)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        if not all(isinstance(item, str) for item in items):
            raise argparse.ArgumentTypeError("the list must hold strings")
        return items
    return [item.strip() for item in value.split(",") if item.strip()]


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedllm.chat_template import load_chat_template
    from pagedllm.engine import LLMEngine
    from pagedllm.server.app import Cors, build_app
    from pagedllm.server.async_engine import AsyncEngine

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be positive; got {args.max_body_bytes}")
    async_engine_args = dict(max_waiting_requests=args.max_waiting_requests)
    AsyncEngine.check_args(**async_engine_args)  # before the minutes a model load may take
    chat_template = load_chat_template(args.chat_template) if args.chat_template else None
    cors = None
    if args.allowed_origins is not None:
        cors = Cors(tuple(args.allowed_origins), tuple(args.allowed_methods),
                    tuple(args.allowed_headers), args.allow_credentials)
    engine = LLMEngine(engine_config_from_args(args))
    name = args.served_model_name or (args.model or DEFAULT_MODEL_NAME)
    app = build_app(AsyncEngine(engine, **async_engine_args), name, api_key=args.api_key,
                    max_body_bytes=args.max_body_bytes, chat_template=chat_template, cors=cors)
    # uvicorn handles SIGINT/SIGTERM: it stops accepting, lets in-flight responses finish
    # (bounded by the timeout), then runs the app's shutdown, which stops the engine thread.
    uvicorn.run(app, host=args.host, port=args.port, log_level="info",
                timeout_graceful_shutdown=30)
    return 0
