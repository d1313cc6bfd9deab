"""Soak run (`make soak`, not part of the test suite): serve a model, drive `pagedllm bench serve`
at a steady rate for a long time (10 minutes by default), and report the server's resident
memory over the run and its KV block accounting once the load stops.

    python -m tests.server.soak --duration-s 600 --request-rate 1 -- --dtype float32

It passes (exit status 0) when every request succeeded and, afterwards, every KV block is free
and no request is left running or waiting. Memory is reported, not judged: the JSON holds RSS
samples, start and end (after a warm-up, so first-use allocations do not count as growth) and
the growth over the second half of the run, where a leak shows as a steady slope.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

MiB = 2**20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.server.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--request-rate", default="1", help="requests/s (Poisson)")
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=64, help="workload size, cycled")
    parser.add_argument("--input-len", default="16-256")
    parser.add_argument("--output-len", default="8-64")
    parser.add_argument("--sample-s", type=float, default=10.0, help="RSS sampling period")
    parser.add_argument("--warmup-requests", type=int, default=16)
    parser.add_argument("--output-json", default="bench-out/soak.json")
    parser.add_argument("serve_args", nargs="*",
                        help="extra `pagedllm serve` flags after --, e.g. -- --dtype float32")
    return parser.parse_args(argv)


def metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    values = {}
    for name in ("kv_cache_blocks_total", "kv_cache_blocks_free", "num_requests_running",
                 "num_requests_waiting", "num_preemptions_total", "generation_tokens_total"):
        match = re.search(rf"^pagedllm:{name} (\S+)$", text, re.M)
        values[name] = float(match.group(1)) if match else float("nan")
    return values


def rss_of(process: psutil.Process) -> int:
    """Resident memory of the server: the API process and its engine core process."""
    return process.memory_info().rss + sum(child.memory_info().rss for child in process.children())


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"gave up waiting for {what} after {timeout_s:.0f}s")


def bench(base_url: str, args: argparse.Namespace, *, rate: str, num_prompts: int,
          duration_s: float | None, output_json: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "pagedllm.cli", "bench", "serve", "--base-url", base_url,
               "--request-rate", rate, "--max-concurrency", str(args.max_concurrency),
               "--num-prompts", str(num_prompts), "--input-len", args.input_len,
               "--output-len", args.output_len, "--output-json", str(output_json)]
    if duration_s is not None:
        command += ["--duration-s", str(duration_s)]
    log = output_json.with_suffix(".log").open("w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    workdir = Path(tempfile.mkdtemp(prefix="pagedllm-soak-"))
    server_log = (workdir / "server.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "pagedllm.cli", "--log-level", "WARNING",
                               "serve", "--host", "127.0.0.1", "--port", str(port), *args.serve_args],
                              stdout=server_log, stderr=subprocess.STDOUT)
    try:
        def started() -> bool:
            if server.poll() is not None:
                server_log.flush()
                log = (workdir / "server.log").read_text()[-2000:]
                raise RuntimeError(f"pagedllm serve exited with status {server.returncode}:\n{log}")
            return httpx.get(f"{base_url}/health", timeout=2).status_code == 200

        wait_for(started, 600, "the server to start")
        process = psutil.Process(server.pid)
        rss_loaded = rss_of(process)
        warmup = bench(base_url, args, rate="inf", num_prompts=args.warmup_requests,
                       duration_s=None, output_json=workdir / "warmup.json")
        warmup.wait()
        rss_start = rss_of(process)
        before = metrics(base_url)

        started = time.monotonic()
        run = bench(base_url, args, rate=args.request_rate, num_prompts=args.num_prompts,
                    duration_s=args.duration_s, output_json=workdir / "bench.json")
        samples = []
        while run.poll() is None:
            samples.append((round(time.monotonic() - started, 1), rss_of(process)))
            time.sleep(args.sample_s)
        served = json.loads((workdir / "bench.json").read_text())

        wait_for(lambda: (lambda m: m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0)(
            metrics(base_url)), 120, "the server to go idle")
        after = metrics(base_url)
        rss_end = rss_of(process)
        health = httpx.get(f"{base_url}/health", timeout=10).status_code
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        server_log.close()

    half = samples[len(samples) // 2:] or samples
    report = {
        "duration_s": args.duration_s, "request_rate": args.request_rate,
        "serve_args": args.serve_args, "input_len": args.input_len, "output_len": args.output_len,
        "requests": served.get("completed", 0) + served.get("failed", 0),
        "completed": served.get("completed"), "failed": served.get("failed"),
        "output_token_throughput": served.get("output_token_throughput"),
        "e2e_latency_ms": served.get("e2e_latency_ms"), "errors": served.get("errors"),
        "rss_loaded_mib": round(rss_loaded / MiB, 1),
        "rss_start_mib": round(rss_start / MiB, 1), "rss_end_mib": round(rss_end / MiB, 1),
        "rss_max_mib": round(max([rss for _, rss in samples] + [rss_end]) / MiB, 1),
        "rss_growth_second_half_mib": round((half[-1][1] - half[0][1]) / MiB, 1) if half else None,
        "rss_samples_mib": [(t, round(rss / MiB, 1)) for t, rss in samples],
        "kv_blocks_total": after["kv_cache_blocks_total"],
        "kv_blocks_free_after": after["kv_cache_blocks_free"],
        "requests_running_after": after["num_requests_running"],
        "requests_waiting_after": after["num_requests_waiting"],
        "preemptions": after["num_preemptions_total"] - before["num_preemptions_total"],
        "health_after": health, "server_log": str(workdir / "server.log"),
    }
    ok = (served.get("failed", 1) == 0 and after["kv_cache_blocks_free"] == after["kv_cache_blocks_total"]
          and after["num_requests_running"] == 0 and after["num_requests_waiting"] == 0 and health == 200)
    report["verdict"] = "pass" if ok else "FAIL"
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps(report, indent=2) + "\n")
    for key, value in report.items():
        if key != "rss_samples_mib":
            print(f"{key:>28}: {value}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
