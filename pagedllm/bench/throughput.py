"""`pagedllm bench throughput`: offline throughput, start-up time and peak memory, with an
optional Hugging Face transformers baseline (static batching) run on the same workload."""

from __future__ import annotations

import argparse
import time

import psutil

from pagedllm.bench.common import (
    engine_config,
    peak_rss_bytes,
    print_table,
    run_workload,
    serve_one,
    write_json,
)
from pagedllm.bench.workload import BenchRequest, load_workload, summarize
from pagedllm.engine import LLMEngine


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", choices=["none", "hf"], default="none")
    parser.add_argument("--hf-batch-size", type=int, default=None,
                        help="static batch size for the HF baseline (default: every request at once)")
    parser.set_defaults(func=main, num_prompts=64, input_len="32-512", output_len="32-256")


def main(args: argparse.Namespace) -> int:
    process_started = psutil.Process().create_time()
    engine = LLMEngine(engine_config(args))
    serve_one(engine)  # start-up counts until a first request is served, as a user sees it
    startup_s = time.time() - process_started
    workload = load_workload(engine.tokenizer, args.dataset, args.num_prompts, args.input_len,
                             args.output_len, args.seed)
    result = run_workload(engine, workload)
    ours = {"system": "pagedllm", "dtype": str(engine.dtype).removeprefix("torch."),
            "device": _device_name(engine.device),
            "startup_s": round(startup_s, 2), "engine_init_s": round(engine.startup_s, 2),
            "peak_rss_mib": round(peak_rss_bytes() / 2**20, 1), "num_preemptions": result.num_preemptions,
            "kv_cache_mib": round(engine.kv_plan.kv_cache_bytes / 2**20, 1),
            **result.rates(), **_peak_gpu_memory(engine.device)}
    payload = {"workload": summarize(workload), "pagedllm": ours}
    rows = [_row(ours)]
    if args.baseline == "hf":
        hf = run_hf_baseline(engine, workload, args.hf_batch_size)
        payload["hf"] = hf
        payload["ratio_output_tokens_per_s"] = round(
            ours["output_tokens_per_s"] / hf["output_tokens_per_s"], 2)
        rows.append(_row(hf))
    print_table(f"Offline throughput: {payload['workload']}",
                ["system", "device", "dtype", "req/s", "out tok/s", "total tok/s", "time s", "start-up s",
                 "peak RSS MiB"], rows)
    if "ratio_output_tokens_per_s" in payload:
        print(f"\npagedllm / transformers generated tokens/s: {payload['ratio_output_tokens_per_s']}x")
    write_json(args.output_json, payload)
    return 0


def _row(r: dict) -> list:
    return [r["system"], r["device"], r["dtype"], r["requests_per_s"], r["output_tokens_per_s"],
            r["total_tokens_per_s"], r["elapsed_s"], r.get("startup_s", "-"), r.get("peak_rss_mib", "-")]


def run_hf_baseline(engine: LLMEngine, workload: list[BenchRequest], batch_size: int | None) -> dict:
    """transformers `generate` on the engine's device, static batches with left padding: a batch
    runs until its longest request is done, and only each request's own max_tokens count as
    useful output."""
    import torch

    from pagedllm.bench.hf_model import load_hf_model

    started = time.time()
    model = load_hf_model(engine.model_path, engine.dtype).to(engine.device)
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
    load_s = time.time() - started
    batch_size = batch_size or len(workload)
    pad_id = engine.tokenizer.eos_token_id or 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(workload), batch_size):
            batch = workload[start:start + batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, r in enumerate(batch):
                ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
                mask[i, width - len(r.prompt_token_ids):] = 1
            longest = max(r.max_tokens for r in batch)
            model.generate(ids.to(engine.device), attention_mask=mask.to(engine.device),
                           max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                           pad_token_id=pad_id)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    elapsed = time.perf_counter() - t0
    prompt_tokens = sum(len(r.prompt_token_ids) for r in workload)
    output_tokens = sum(r.max_tokens for r in workload)
    return {"system": "transformers", "dtype": str(engine.dtype).removeprefix("torch."),
            "device": _device_name(engine.device), **_peak_gpu_memory(engine.device),
            "batch_size": batch_size, "load_s": round(load_s, 2), "elapsed_s": round(elapsed, 3),
            "requests_per_s": round(len(workload) / elapsed, 3),
            "output_tokens_per_s": round(output_tokens / elapsed, 2),
            "total_tokens_per_s": round((prompt_tokens + output_tokens) / elapsed, 2)}


def _device_name(device) -> str:
    """"cpu", or the GPU's name (what a tokens/s figure on a GPU means depends on it)."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _peak_gpu_memory(device) -> dict:
    import torch

    if device.type != "cuda":
        return {}
    return {"peak_gpu_mib": round(torch.cuda.max_memory_allocated(device) / 2**20, 1)}
