"""`pagedllm serve`: start the engine core process, then serve the OpenAI-compatible API with
uvicorn in this process (the API process: HTTP, tokenizing, detokenizing; see
pagedllm/engine/core_client.py for why two processes)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from pagedllm.config import (
    SERVE_MAX_NUM_BATCHED_TOKENS,
    EngineConfig,
    add_config_args,
    add_engine_args,
    config_from_args,
    engine_config_from_args,
)
from pagedllm.model.default_model import DEFAULT_MODEL_NAME
from pagedllm.server.config import ServerConfig
from pagedllm.server.hosts import allowed_hosts_for

logger = logging.getLogger(__name__)


def register(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="HF folder or .gguf file, as `vllm serve MODEL` (or --model)")
    add_engine_args(serve)
    add_config_args(serve, ServerConfig, "server")
    serve.set_defaults(func=cmd_serve, max_num_batched_tokens=SERVE_MAX_NUM_BATCHED_TOKENS)


def serve_configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """The engine's and the server's settings the flags ask for, validated (before any load).
    The model may be given as `serve MODEL` or --model, not as two different ones."""
    model = args.model
    if args.model_tag is not None:
        if model is not None and model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {model!r}")
        model = args.model_tag
    return engine_config_from_args(args, model=model), config_from_args(ServerConfig, args)


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
    from pagedllm.server.stale_sockets import remove_stale_socket_dirs
    from pagedllm.text.chat_template import load_chat_template

    config, settings = serve_configs(args)
    api_key = settings.resolve_api_key()
    allowed_hosts = allowed_hosts_for(settings.host, settings.allowed_hosts,
                                      unix_socket=settings.uds is not None)
    limits = fit_to_open_files(ConnectionLimits(settings.max_connections, settings.header_timeout_s,
                                                settings.keep_alive_s))
    chat_template = load_chat_template(settings.chat_template) if settings.chat_template else None
    num_threads, why = choose_num_threads(settings.num_threads)
    if settings.uds is None:
        check_port_free(settings.host, settings.port)  # before the model load, not after it
    remove_stale_socket_dirs()  # what servers killed before (SIGKILL runs no clean-up) left
    core = CoreProcess(config, num_threads)  # loads the model while this process reads the tokenizer
    try:
        import uvicorn

        from pagedllm.model.tokenizer_files import load_tokenizer
        from pagedllm.server.answer_options import AnswerOptions
        from pagedllm.server.app import Cors, build_app

        try:
            tokenizer, tokenizer_error = load_tokenizer(config.model), None
        except (ValueError, FileNotFoundError) as exc:  # the core's own error about it says more
            tokenizer, tokenizer_error = None, exc
        ready = core.wait_ready()
        if tokenizer_error is not None:
            raise tokenizer_error
        logger.info("engine core ready (pid %d): %s; %d torch thread%s (%s); ready %.2f s "
                    "after its start, %.2f s after this process's", ready.pid, ready.description,
                    ready.num_threads,
                    "" if ready.num_threads == 1 else "s", why, ready.startup_s, _since_process_start())
        engine = AsyncEngine(core, tokenizer, max_waiting_requests=settings.max_waiting_requests)
        cors = None
        if settings.allowed_origins is not None:
            cors = Cors(settings.allowed_origins, settings.allowed_methods, settings.allowed_headers,
                        settings.allow_credentials)
        name = settings.served_model_name or (config.model or DEFAULT_MODEL_NAME)
        app = build_app(engine, name, api_key=api_key, max_body_bytes=settings.max_body_bytes,
                        chat_template=chat_template, cors=cors, body_timeout_s=settings.body_timeout_s,
                        allowed_hosts=allowed_hosts, reasoning_parser=settings.reasoning_parser,
                        options=AnswerOptions(settings.return_tokens_as_token_ids,
                                              settings.enable_force_include_usage,
                                              settings.enable_prompt_tokens_details),
                        root_path=settings.root_path,
                        enable_tokenizer_info_endpoint=settings.enable_tokenizer_info_endpoint)
        limit_repeated_log_lines()
        # uvicorn handles SIGINT/SIGTERM: it stops accepting, lets in-flight responses finish
        # (bounded by the timeout), then runs the app's shutdown, which stops the core. A core
        # that dies stops the server the same way.
        server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, uds=settings.uds,
                                               log_level="info", timeout_graceful_shutdown=30,
                                               **uvicorn_settings(limits)))
        engine.on_dead = lambda reason: setattr(server, "should_exit", True)
        server.run()
    finally:
        core.close()
    if engine.dead_reason is not None:
        print(f"pagedllm: error: {engine.dead_reason}; the server stopped", file=sys.stderr)
        return 1
    return 0


def check_port_free(host: str, port: int) -> None:
    """ValueError (one line) if host:port cannot be bound: a second server on a used port used
    to load the whole model before failing (issue 32, finding 8). Bound as uvicorn binds it
    (SO_REUSEADDR), then closed; port 0 (any free one) always passes."""
    import socket

    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (another "
                             "server there?); choose another --port or --host") from None


def _since_process_start() -> float:
    import psutil

    return time.time() - psutil.Process().create_time()
