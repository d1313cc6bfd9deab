"""pytest plugin for run.sh: vLLM's own server tests, unmodified, against `vllm serve` or `pagedllm serve`.

vLLM's tests start their server through tests/utils.py's RemoteOpenAIServer(model, args). This plugin
replaces two of its methods: the constructor serves the local model folder ($COMPARE_MODEL_DIR) under
the name the test asked for (`--served-model-name`, unless the test names one itself), and
_start_server starts the system named by $COMPARE_SERVER with the test's own arguments. For pagedllm
the arguments its `serve` does not know are dropped, each with the values vLLM's parser says it takes,
and printed (one line per server start, and all of them in $COMPARE_OUT/dropped-flags.txt).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SERVER = os.environ["COMPARE_SERVER"]  # vllm | pagedllm
MODEL_DIR = os.environ["COMPARE_MODEL_DIR"]
OUT = Path(os.environ["COMPARE_OUT"])


def vllm_command(model: str, args: list[str]) -> tuple[list[str], dict[str, str]]:
    anchor = os.environ["COMPARE_VLLM_DIR"]
    gomp = f"{anchor}/venv/lib/python3.11/site-packages/torch/lib/libgomp.so.1"
    # eager: torch.compile's start-up takes minutes on 2 cores and changes no API behaviour
    extra = [] if "--enforce-eager" in args else ["--enforce-eager"]
    env = {"LD_PRELOAD": gomp, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    return [sys.executable, f"{anchor}/vllm_cli.py", "serve", model, *args, *extra], env


def pagedllm_flags() -> set[str]:
    return set(Path(os.environ["COMPARE_PAGEDLLM_FLAGS"]).read_text().split())


def values_taken(option: str) -> int:
    """How many values vLLM's serve parser gives `option` (0 for a switch)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    parser = ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    for action in parser._actions:
        if option in action.option_strings:
            return 0 if action.nargs == 0 else 1
    return 1


def split_args(args: list[str], known: set[str]) -> tuple[list[str], list[str]]:
    """The arguments pagedllm knows, and the ones dropped (with their values)."""
    kept, dropped, i = [], [], 0
    while i < len(args):
        arg = args[i]
        name = arg.split("=", 1)[0]
        if not arg.startswith("-") or name in known:
            kept.append(arg)
            i += 1
            continue
        taken = 0 if "=" in arg else values_taken(name)
        dropped.extend(args[i:i + 1 + taken])
        i += 1 + taken
    return kept, dropped


def pagedllm_command(model: str, args: list[str]) -> tuple[list[str], dict[str, str]]:
    kept, dropped = split_args(args, pagedllm_flags())
    if dropped:
        line = " ".join(dropped)
        print(f"[compare] pagedllm serve: dropped vLLM-only flags: {line}", flush=True)
        with open(OUT / "dropped-flags.txt", "a") as f:
            f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]}: {line}\n")
    tree = os.environ["COMPARE_PAGEDLLM_TREE"]
    env = {"PYTHONPATH": tree}
    return [os.environ["COMPARE_PAGEDLLM_PYTHON"], "-m", "pagedllm.cli", "serve", model, *kept], env


def start_server(self, model: str, vllm_serve_args: list[str], env_dict: dict[str, str] | None) -> None:
    command = vllm_command if SERVER == "vllm" else pagedllm_command
    cmd, extra_env = command(model, vllm_serve_args)
    env = {**os.environ, **(env_dict or {}), **extra_env}
    print(f"[compare] starting: {' '.join(cmd)}", flush=True)
    log = open(OUT / "server.log", "ab")
    self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def pytest_configure(config) -> None:
    import tests.utils as utils

    server_class = utils.RemoteOpenAIServer
    original_init = server_class.__init__

    def init(self, model, vllm_serve_args, *args, **kwargs):
        served = list(vllm_serve_args)
        if "--served-model-name" not in served:
            served += ["--served-model-name", model]
        # a CPU shared with other work starts a server in minutes, not CI's seconds
        kwargs["max_wait_seconds"] = max(kwargs.get("max_wait_seconds") or 0, 900)
        original_init(self, MODEL_DIR, served, *args, **kwargs)

    server_class.__init__ = init
    server_class._start_server = start_server
