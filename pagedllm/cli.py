"""`pagedllm generate | chat | serve | bench ...`"""

from __future__ import annotations

import argparse
import logging
import sys

from pagedllm import envs
from pagedllm.config import add_engine_args, engine_config_from_args

logger = logging.getLogger(__name__)


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")


def _sampling_params(args: argparse.Namespace):
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(**vars(engine_config_from_args(args)))
    output = llm.generate(args.prompt, _sampling_params(args), use_tqdm=False)[0]
    print(output.outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.chat_repl import run_chat

    return run_chat(engine_config_from_args(args), _sampling_params(args), args.system)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt")
    add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streaming tokens as they come")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    for register in _optional_commands():
        register(sub)
    return parser


def _optional_commands():
    """Subcommands living in other modules (serve, bench), registered if present."""
    registrars = []
    try:
        from pagedllm.server.cli import register as register_serve
        registrars.append(register_serve)
    except ImportError:
        pass
    try:
        from pagedllm.bench.cli import register as register_bench
        registrars.append(register_bench)
    except ImportError:
        pass
    return registrars


def main(argv: list[str] | None = None) -> int:
    envs.apply_process_defaults()  # before torch is imported: OpenMP reads them once
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    undeclared = envs.undeclared_pagedllm_variables()
    if undeclared:
        logger.warning("ignoring %s: pagedllm reads no such environment variable (pagedllm/envs.py "
                       "lists those it does)", ", ".join(undeclared))
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagedllm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
