"""`pagedllm bench serve`: load a running OpenAI-compatible server the way vLLM's `bench serve`
does (Poisson arrivals at --request-rate or all at once, --max-concurrency, streaming) and
report throughput, TTFT, TPOT, ITL and end-to-end latency with mean / p50 / p90 / p99.

--loads runs several loads in turn, each with other prompts (another seed, so that no run hits
the prefix cache another one filled), e.g. `--loads rate=2,concurrency=8,rate=inf` (what
/work/shared/tools/vllm-cpu/serve-compare.sh runs against vLLM), prints one line per load
(output tok/s, TTFT, TPOT and ITL medians and p99) and with --plot draws TTFT and TPOT against
load.

Definitions (as vLLM's): TTFT = first streamed token - request sent; TPOT = (latency - TTFT) /
(output tokens - 1) per request; ITL = every gap between consecutive streamed chunks; E2E =
last chunk - request sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

from pagedllm.bench.common import print_table, write_json
from pagedllm.bench.workload import BenchRequest, load_workload, summarize


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's)")
    parser.add_argument("--tokenizer", default=None,
                        help="model path whose tokenizer builds the prompts (default: the default model)")
    parser.add_argument("--request-rate", default="inf", help="requests/s (Poisson) or inf")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--duration-s", type=float, default=None,
                        help="keep sending (cycling the workload) for this long; for soak runs")
    parser.add_argument("--loads", default=None,
                        help="several loads in turn, comma-separated: rate=R (Poisson, R req/s or "
                             "inf) or concurrency=N (all at once, N at most in flight); e.g. "
                             "rate=2,concurrency=8,rate=inf")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sent with every request (vLLM's client sends none: 1)")
    parser.add_argument("--plot", default=None, help="PNG of TTFT and TPOT against load (--loads)")
    parser.set_defaults(func=main, num_prompts=64, input_len="32-512", output_len="32-256")


@dataclass(frozen=True)
class Load:
    request_rate: float  # requests/s, Poisson arrivals; inf: all at once
    max_concurrency: int | None = None

    @property
    def label(self) -> str:
        if self.max_concurrency is not None:
            return f"concurrency {self.max_concurrency}" if self.request_rate == float("inf") else \
                f"rate {self.request_rate:g}, concurrency {self.max_concurrency}"
        return f"rate {self.request_rate:g}"


def parse_loads(text: str) -> list[Load]:
    """"rate=2,concurrency=8,rate=inf" -> [rate 2, concurrency 8 (at rate inf), rate inf]."""
    loads = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, _, value = item.partition("=")
        try:
            if kind == "rate":
                rate = float(value)
                if not rate > 0:
                    raise ValueError
                loads.append(Load(rate))
                continue
            if kind == "concurrency" and int(value) >= 1:
                loads.append(Load(float("inf"), int(value)))
                continue
        except ValueError:
            pass
        raise ValueError(f"--loads takes rate=R (R > 0 or inf) or concurrency=N (N >= 1), comma-"
                         f"separated; got {item!r}")
    if not loads:
        raise ValueError("--loads is empty")
    return loads


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


def main(args: argparse.Namespace) -> int:
    if args.loads is None:
        payload = asyncio.run(run(args, Load(float(args.request_rate), args.max_concurrency)))
        write_json(args.output_json, payload)
        return 0 if payload["failed"] == 0 else 1
    loads = parse_loads(args.loads)
    runs = [asyncio.run(run(args, load, seed=args.seed + k)) for k, load in enumerate(loads)]
    print_sweep(runs)
    if args.plot:
        plot_sweep(runs, args.plot)
    write_json(args.output_json, {"runs": runs})
    return 0 if all(r["failed"] == 0 for r in runs) else 1


async def run(args: argparse.Namespace, load: Load, seed: int | None = None) -> dict:
    import httpx

    seed = args.seed if seed is None else seed
    workload = _workload(args, seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=None,
                                 limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        results, elapsed = await _drive(client, model, workload, load, seed, args)
    payload = report(results, elapsed, args, load)
    payload["workload"] = summarize(workload)
    return payload


def _workload(args, seed: int) -> list[BenchRequest]:
    # Prompts are sent as token ids of the served model's tokenizer, so lengths are exact.
    from pagedllm.model.tokenizer_files import load_tokenizer

    return load_workload(load_tokenizer(args.tokenizer), args.dataset, args.num_prompts,
                         args.input_len, args.output_len, seed)


async def _drive(client, model: str, workload: list[BenchRequest], load: Load, seed: int,
                 args) -> tuple[list, float]:
    rate = load.request_rate
    rng = random.Random(seed)
    limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    tasks = []
    started = time.perf_counter()
    deadline = started + args.duration_s if args.duration_s else None
    i = 0
    while deadline is not None or i < len(workload):
        if deadline is not None and time.perf_counter() >= deadline:
            break
        if limit is not None:  # hold new arrivals while the concurrency cap is reached
            await limit.acquire()
        request = workload[i % len(workload)]
        tasks.append(asyncio.create_task(_one(client, model, request, limit, args.temperature)))
        i += 1
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
        else:
            await asyncio.sleep(0)
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - started


async def _one(client, model: str, request: BenchRequest, limit, temperature: float) -> RequestResult:
    try:
        return await _stream_one(client, model, request, temperature)
    finally:
        if limit is not None:
            limit.release()


async def _stream_one(client, model: str, request: BenchRequest, temperature: float) -> RequestResult:
    body = {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.max_tokens,
            "temperature": temperature, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    result = RequestResult(ok=False, prompt_tokens=len(request.prompt_token_ids))
    sent = time.perf_counter()
    last = sent
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if result.ttft_s == 0.0:
                        result.ttft_s = now - sent
                    else:
                        result.itl_s.append(now - last)
                    last = now
        result.latency_s = last - sent
        result.ok = True
    except Exception as exc:  # a failed request is counted, not fatal to the run
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _stats_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]

    return {"mean": round(1000 * statistics.fmean(values), 2), "p50": round(1000 * pct(50), 2),
            "p90": round(1000 * pct(90), 2), "p99": round(1000 * pct(99), 2)}


def report(results: list[RequestResult], elapsed: float, args, load: Load) -> dict:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    payload = {
        "base_url": args.base_url, "load": load.label, "request_rate": str(load.request_rate),
        "max_concurrency": load.max_concurrency, "temperature": args.temperature, "completed": len(ok),
        "failed": len(results) - len(ok), "duration_s": round(elapsed, 2),
        "request_throughput": round(len(ok) / elapsed, 3),
        "output_token_throughput": round(output_tokens / elapsed, 2),
        "total_token_throughput": round((output_tokens + sum(r.prompt_tokens for r in ok)) / elapsed, 2),
        "ttft_ms": _stats_ms([r.ttft_s for r in ok]),
        "tpot_ms": _stats_ms(tpot),
        "itl_ms": _stats_ms([x for r in ok for x in r.itl_s]),
        "e2e_latency_ms": _stats_ms([r.latency_s for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    print(f"\n{load.label}: successful requests: {payload['completed']}   failed: {payload['failed']}   "
          f"duration: {payload['duration_s']} s")
    print(f"Request throughput: {payload['request_throughput']} req/s   output tokens: "
          f"{payload['output_token_throughput']} tok/s   total: {payload['total_token_throughput']} tok/s")
    rows = [[name, *payload[key].values()] for name, key in
            [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E latency", "e2e_latency_ms")]]
    print_table("Latency (ms)", ["metric", "mean", "p50", "p90", "p99"], rows)
    if payload["errors"]:
        print("errors:", *payload["errors"], sep="\n  ")
    return payload


def print_sweep(runs: list[dict]) -> None:
    """One line per load: the figures serve-compare.sh compares."""
    rows = [[r["load"], f"{r['completed']}/{r['completed'] + r['failed']}", r["output_token_throughput"],
             r["ttft_ms"]["p50"], r["ttft_ms"]["p99"], r["tpot_ms"]["p50"], r["tpot_ms"]["p99"],
             r["itl_ms"]["p50"], r["itl_ms"]["p99"]] for r in runs]
    print_table("Loads", ["load", "ok", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
                          "ITL p50", "ITL p99"], rows)


def plot_sweep(runs: list[dict], path: str) -> None:
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["load"] for r in runs]
    x = range(len(runs))
    panels = [("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"),
              ("output_token_throughput", "output tokens/s")]
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4))
    for ax, (key, title) in zip(axes, panels):
        if key == "output_token_throughput":
            ax.bar(x, [r[key] for r in runs])
        else:
            ax.plot(x, [r[key]["p50"] for r in runs], marker="o", label="median")
            ax.plot(x, [r[key]["p99"] for r in runs], marker="^", linestyle="--", label="p99")
            ax.legend()
        ax.set_xticks(list(x), labels, rotation=15)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    fig.suptitle(f"pagedllm bench serve: {runs[0]['workload']['num_requests']} requests per load")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")
