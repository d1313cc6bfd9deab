"""`pagedllm serve`: start the engine core process, then serve the OpenAI-compatible API with
uvicorn in this process (the API process: HTTP, tokenizing, detokenizing; see
pagedllm/engine/core_client.py for why two processes)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from pagedllm.config import SERVE_MAX_NUM_BATCHED_TOKENS, add_engine_args, engine_config_from_args
from pagedllm.model.default_model import DEFAULT_MODEL_NAME
from pagedllm.server.hosts import allowed_hosts_for
from pagedllm.server.keys import API_KEY_ENV, VLLM_API_KEY_ENV, read_api_key
from pagedllm.server.protocol import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_WAITING_REQUESTS,
)

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
                            "and on the live data of the dashboard at / (the page asks for it); "
                            f"or set {API_KEY_ENV} (or {VLLM_API_KEY_ENV}), or --api-key-file, "
                            "so that the key is not in the process list")
    serve.add_argument("--api-key-file", default=None,
                       help="a file holding the API key (its first line)")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--chat-template", default=None,
                       help="a Jinja chat template, or a file holding one, for every chat request "
                            "instead of the model's")
    serve.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help=f"larger request bodies get 413 (default {DEFAULT_MAX_BODY_BYTES // 2**20} MiB)")
    serve.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                       help="requests past this many waiting for the engine get a fast 503 with "
                            f"Retry-After (default {DEFAULT_MAX_WAITING_REQUESTS})")
    serve.add_argument("--num-threads", type=int, default=None,
                       help="torch threads of the engine core process (default: one per core; "
                            "fewer where other busy processes share the cores)")
    conns = serve.add_argument_group("connections")
    conns.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                       help="open connections at most (kept under the open-files limit): past it "
                            "the oldest one still waiting for its request headers is closed, or, "
                            f"when all are busy, a new one gets 503 (default {DEFAULT_MAX_CONNECTIONS})")
    conns.add_argument("--header-timeout-s", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                       help="a connection's request headers must arrive within this, or it is "
                            f"closed (default {DEFAULT_HEADER_TIMEOUT_S:g})")
    conns.add_argument("--body-timeout-s", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                       help="a request's body must arrive within this, or it gets 408 and the "
                            f"connection is closed (default {DEFAULT_BODY_TIMEOUT_S:g})")
    conns.add_argument("--keep-alive-s", type=float, default=DEFAULT_KEEP_ALIVE_S,
                       help="an idle kept-alive connection is closed after this "
                            f"(default {DEFAULT_KEEP_ALIVE_S:g})")
    conns.add_argument("--allowed-hosts", type=_string_list, default=None,
                       help="Host header values accepted (JSON list or comma-separated; a port "
                            "may follow each); others get 421. Default: for a loopback --host, "
                            "localhost, 127.0.0.1 and [::1] (against DNS rebinding); otherwise any. "
                            "'*' accepts any")
    cors = serve.add_argument_group("CORS (off unless --allowed-origins is given)")
    cors.add_argument("--allowed-origins", type=_string_list, default=None,
                      help='origins browsers may call from: a JSON list (\'["https://a.example"]\', '
                           '\'["*"]\') or comma-separated')
    cors.add_argument("--allowed-methods", type=_string_list, default=["*"])
    cors.add_argument("--allowed-headers", type=_string_list, default=["*"])
    cors.add_argument("--allow-credentials", action="store_true")
    serve.set_defaults(func=cmd_serve, max_num_batched_tokens=SERVE_MAX_NUM_BATCHED_TOKENS)


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


def choose_num_threads(requested: int | None) -> tuple[int, str]:
    """How many torch threads the core computes with, and why (for the start-up line).

    One per core this process may use, as vLLM serves here (its OpenMP threads bound to every
    core). The API process is idle ~95% of the time while the core is busy (py-spy over both,
    docs/benchmarks-notebook.md Serving), so keeping a core for it cost more than it gave: on a quiet
    machine one thread left the core's TPOT at rate 2 at 79 ms against 37 ms with two. On a
    machine whose cores other busy processes share, fewer threads (--num-threads 1) wait less at
    the OpenMP barriers: the same page has that measurement too."""
    if requested is not None:
        return requested, "--num-threads"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores, f"one per core ({cores}); --num-threads to change"


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedllm.engine.core_client import CoreProcess
    from pagedllm.server.async_engine import AsyncEngine
    from pagedllm.server.connections import (
        ConnectionLimits,
        fit_to_open_files,
        limit_repeated_log_lines,
        uvicorn_settings,
    )
    from pagedllm.text.chat_template import load_chat_template

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be positive; got {args.max_body_bytes}")
    if args.num_threads is not None and args.num_threads < 1:
        raise ValueError(f"--num-threads must be at least 1; got {args.num_threads}")
    if not args.body_timeout_s > 0:
        raise ValueError(f"--body-timeout-s must be positive; got {args.body_timeout_s}")
    api_key = read_api_key(args.api_key, args.api_key_file)
    allowed_hosts = allowed_hosts_for(args.host, args.allowed_hosts)
    limits = fit_to_open_files(ConnectionLimits(args.max_connections, args.header_timeout_s,
                                                args.keep_alive_s))
    async_engine_args = dict(max_waiting_requests=args.max_waiting_requests)
    AsyncEngine.check_args(**async_engine_args)  # before the minutes a model load may take
    chat_template = load_chat_template(args.chat_template) if args.chat_template else None
    config = engine_config_from_args(args)
    num_threads, why = choose_num_threads(args.num_threads)
    core = CoreProcess(config, num_threads)  # loads the model while this process reads the tokenizer
    try:
        import uvicorn

        from pagedllm.model.tokenizer_files import load_tokenizer
        from pagedllm.server.app import Cors, build_app

        try:
            tokenizer, tokenizer_error = load_tokenizer(config.model), None
        except (ValueError, FileNotFoundError) as exc:  # the core's own error about it says more
            tokenizer, tokenizer_error = None, exc
        ready = core.wait_ready()
        if tokenizer_error is not None:
            raise tokenizer_error
        logger.info("engine core ready (pid %d, %s, %s): %s; %d torch thread%s (%s); ready %.2f s "
                    "after its start, %.2f s after this process's", ready.pid, ready.device,
                    ready.dtype, ready.description, ready.num_threads,
                    "" if ready.num_threads == 1 else "s", why, ready.startup_s, _since_process_start())
        engine = AsyncEngine(core, tokenizer, **async_engine_args)
        cors = None
        if args.allowed_origins is not None:
            cors = Cors(tuple(args.allowed_origins), tuple(args.allowed_methods),
                        tuple(args.allowed_headers), args.allow_credentials)
        name = args.served_model_name or (args.model or DEFAULT_MODEL_NAME)
        app = build_app(engine, name, api_key=api_key, max_body_bytes=args.max_body_bytes,
                        chat_template=chat_template, cors=cors, body_timeout_s=args.body_timeout_s,
                        allowed_hosts=allowed_hosts)
        limit_repeated_log_lines()
        # uvicorn handles SIGINT/SIGTERM: it stops accepting, lets in-flight responses finish
        # (bounded by the timeout), then runs the app's shutdown, which stops the core. A core
        # that dies stops the server the same way.
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                                               timeout_graceful_shutdown=30,
                                               **uvicorn_settings(limits)))
        engine.on_dead = lambda reason: setattr(server, "should_exit", True)
        server.run()
    finally:
        core.close()
    if engine.dead_reason is not None:
        print(f"pagedllm: error: {engine.dead_reason}; the server stopped", file=sys.stderr)
        return 1
    return 0


def _since_process_start() -> float:
    import psutil

    return time.time() - psutil.Process().create_time()
