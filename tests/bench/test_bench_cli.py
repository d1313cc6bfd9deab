"""`pagedllm bench ...` registration: a bench's module is imported only when that bench runs."""

from __future__ import annotations

import json
import subprocess
import sys

from pagedllm.bench.cli import BENCHES

PROBE = """
import json, sys
from pagedllm.cli import build_parser
parser = build_parser()
before = sorted(m for m in sys.modules if m.startswith("pagedllm.bench.") or m == "torch._dynamo")
args = parser.parse_args(sys.argv[1:])
after = sorted(m for m in sys.modules if m.startswith("pagedllm.bench.") or m == "torch._dynamo")
print(json.dumps({"before": before, "after": after, "num_prompts": args.num_prompts,
                  "func": args.func.__module__}))
"""


def probe(*argv: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_building_the_cli_imports_no_bench_and_a_bench_brings_its_own_flags():
    seen = probe("bench", "throughput", "--threads", "1")
    bench_modules = {module for module, _ in BENCHES.values()}
    # `pagedllm serve` builds the same parser: no bench's imports (torch._dynamo) in a server.
    assert not bench_modules & set(seen["before"]) and "torch._dynamo" not in seen["before"]
    assert "pagedllm.bench.throughput" in seen["after"]
    assert "pagedllm.bench.structured" not in seen["after"]
    assert seen["num_prompts"] == 64 and seen["func"] == "pagedllm.bench.throughput"  # its defaults


def test_throughput_reports_the_cpu_tier_with_its_figures():
    import torch

    from pagedllm.bench import throughput
    from tests.kernel_tiers import kernel_tier

    with kernel_tier("portable"):
        fields = throughput.cpu_tier_fields(torch.device("cpu"))
        assert throughput.cpu_tier_fields(torch.device("cuda")) == {}
    assert fields["cpu_tier"] == "portable" and "attention torch" in fields["cpu_kernels"]
    assert throughput._label({"system": "pagedllm", **fields}) == "pagedllm (portable)"
    assert throughput._label({"system": "llama.cpp"}) == "llama.cpp"
