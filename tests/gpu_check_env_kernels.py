"""gpu-check's stages 1 to 3: the environment (the GPU, its driver, the library versions, a copy's
bandwidth and a bf16 matmul's rate), the GPU tests run natively, and the Triton kernels against
torch's reference at real shapes (tests/gpu_check.py runs them)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time

from tests.gpu_check_common import (
    ROOT,
    Check,
    _event_median_ms,
)

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
