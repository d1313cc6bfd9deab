"""gpu-check's stages 4 to 6: the models (the default one, from its GGUF where it came, and a
random-weight Llama of ~1B real shapes), throughput against transformers' static batches, and
decode at batch 1 with CUDA graphs and eagerly, each measurement in a process of its own
(`python -m tests.gpu_check decode ...` runs decode_main; tests/gpu_check.py runs the stages)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tests.gpu_check_common import (
    H200_PEAK_TB_S,
    LARGE_SHAPE,
    MODELS,
    ROOT,
    SMOKE_LARGE_SHAPE,
    Check,
    Settings,
)

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

