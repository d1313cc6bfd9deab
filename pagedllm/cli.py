"""`pagedllm generate | chat | serve | bench ...`"""

from __future__ import annotations

import argparse
import logging
import sys

from pagedllm import envs
from pagedllm.config import add_engine_args, engine_config_from_args

logger = logging.getLogger(__name__)

# generate's and chat's sampling flags, SamplingParams fields: field -> (flag, type, help); each
# parsed into `sampling_<field>`, apart from the engine's flags (--seed is the engine's). Left
# unset, a field takes the model's generation_config.json value (--generation-config says which
# file, or none), then SamplingParams' own, as a request to LLM.generate or the server does.
SAMPLING_FLAGS = {
    "max_tokens": ("--max-tokens", int, "tokens to generate at most"),
    "temperature": ("--temperature", float, "0: greedy"),
    "top_p": ("--top-p", float, "sample from the smallest set of tokens this likely"),
    "top_k": ("--top-k", int, "sample from this many most likely tokens (-1: all)"),
    "min_p": ("--min-p", float, "drop tokens less likely than this times the most likely one"),
    "repetition_penalty": ("--repetition-penalty", float,
                           "above 1 discourages tokens already in the prompt or the output"),
    "seed": ("--sampling-seed", int, "the request's own seed (default: none, the engine's random "
                                     "stream, which --seed seeds)"),
}


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens_default: str) -> None:
    group = parser.add_argument_group(
        "sampling", "left unset, the model's generation_config.json applies (see --generation-config), "
                    "then the library's defaults")
    for name, (flag, kind, help_text) in SAMPLING_FLAGS.items():
        if name == "max_tokens":
            help_text += f" (default: {max_tokens_default})"
        group.add_argument(flag, dest=f"sampling_{name}", type=kind, default=None, help=help_text)


def sampling_overrides(args: argparse.Namespace) -> dict:
    """The SamplingParams fields the command line set (the others are left to the defaults)."""
    given = {name: getattr(args, f"sampling_{name}") for name in SAMPLING_FLAGS}
    return {name: value for name, value in given.items() if value is not None}


def cmd_generate(args: argparse.Namespace) -> int:
    import dataclasses

    from pagedllm.entrypoints.llm import LLM

    llm = LLM(**vars(engine_config_from_args(args)))
    params = dataclasses.replace(llm.get_default_sampling_params(), **sampling_overrides(args))
    output = llm.generate(args.prompt, params, use_tqdm=False)[0]
    print(output.outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.chat_repl import run_chat

    return run_chat(engine_config_from_args(args), sampling_overrides(args), args.system)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt")
    add_engine_args(gen)
    _add_sampling_args(gen, "16, as LLM.generate and /v1/completions")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streaming tokens as they come")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    _add_sampling_args(chat, "none: until the reply ends or the context is full, as "
                             "/v1/chat/completions")
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
