"""`make gpu-check`: the GPU path on a machine with CUDA, in one run of a few minutes.

1. The tests that need a GPU, natively: the Triton kernel against the torch path
   (tests/kernels/test_triton_attention.py), the model and engine against transformers with
   TF32 off (tests/model/test_cuda.py), the fake-device placement checks (tests/test_device.py).
2. `pagedllm bench throughput --device cuda --baseline hf` on the default model, and on
   GPU_CHECK_MODEL (a larger Llama-family folder or .gguf) when one is given.
3. A short report, printed and written to bench-out/gpu-check.md, whose table rows are ready for
   docs/benchmarks.md.

Exits non-zero when CUDA is missing, a test fails or a bench fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TESTS = ["tests/kernels/test_triton_attention.py", "tests/model/test_cuda.py", "tests/test_device.py"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.environ.get("GPU_CHECK_MODEL") or None,
                        help="a larger model to bench besides the default one (GPU_CHECK_MODEL)")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out-dir", default="bench-out")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        why = (f"torch {torch.__version__} is a CPU build: install a CUDA build of the same version "
               "into .venv" if torch.version.cuda is None else "no CUDA GPU is visible")
        print(f"gpu-check: no CUDA device ({why})", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    report = [f"# gpu-check, {time.strftime('%Y-%m-%d')}", "", _environment(torch), ""]

    tests_rc, tests_summary, tests_s = _run_tests()
    report += [f"Tests ({', '.join(TESTS)}): {tests_summary} in {tests_s:.0f} s", ""]

    models = [("default (SmolLM2-135M-Instruct)", None)]
    if args.model:
        models.append((args.model, args.model))
    bench_rc = 0
    rows = []
    for label, model in models:
        payload, seconds = _bench(model, args, out_dir / f"gpu-throughput-{len(rows)}.json")
        if payload is None:
            bench_rc = 1
            report.append(f"bench throughput on {label}: FAILED (see the output above)")
            continue
        rows.append(_table_row(label, payload))
        report.append(f"bench throughput on {label}: {seconds:.0f} s")
    report += ["", "| model | dtype | workload | pagedllm out tok/s | transformers out tok/s | ratio |",
               "|---|---|---|---|---|---|", *rows, "",
               f"Whole check: {time.monotonic() - started:.0f} s"]
    text = "\n".join(report)
    print("\n" + text)
    (out_dir / "gpu-check.md").write_text(text + "\n")
    return tests_rc or bench_rc


def _environment(torch) -> str:
    import triton

    props = torch.cuda.get_device_properties(0)
    return (f"{torch.cuda.get_device_name(0)} ({props.total_memory / 2**30:.0f} GiB), "
            f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")


def _run_tests() -> tuple[int, str, float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", *TESTS, "-q", "-p", "no:cacheprovider", "-rs"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(proc.stdout)
    summary = next((line.strip("= ") for line in reversed(proc.stdout.splitlines())
                    if " passed" in line or " failed" in line or " error" in line), "no summary")
    return proc.returncode, summary, time.monotonic() - started


def _bench(model: str | None, args, output: Path) -> tuple[dict | None, float]:
    command = [sys.executable, "-m", "pagedllm.cli", "--log-level", "WARNING", "bench", "throughput",
               "--device", "cuda", "--dtype", args.dtype, "--baseline", "hf",
               "--num-prompts", str(args.num_prompts), "--output-json", str(output)]
    if model:
        command += ["--model", model]
    started = time.monotonic()
    proc = subprocess.run(command)
    seconds = time.monotonic() - started
    if proc.returncode != 0 or not output.is_file():
        return None, seconds
    return json.loads(output.read_text()), seconds


def _table_row(label: str, payload: dict) -> str:
    ours, hf, work = payload["pagedllm"], payload["hf"], payload["workload"]
    workload = f"{work['num_requests']} req, {work['prompt_tokens']} in / {work['output_tokens']} out"
    return (f"| {label} | {ours['dtype']} | {workload} | {ours['output_tokens_per_s']} | "
            f"{hf['output_tokens_per_s']} | {payload['ratio_output_tokens_per_s']}x |")


if __name__ == "__main__":
    sys.exit(main())
