"""`pagedllm bench throughput`: offline throughput, start-up time and memory, with an optional
baseline (bench/baselines.py: transformers, llama.cpp) run on the same requests in the same run.

pagedllm always runs the workload batched (every request at once). A baseline adds the scenarios
it takes part in (bench/scenarios.py), and pagedllm runs those too, request by request in turn
with the baseline (A, B, A, B, ...), so load on the machine falls on both alike. Before each later
run of requests the engine has served, its prefix cache is emptied: no rerun skips its prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import psutil

from pagedllm.bench import baselines
from pagedllm.bench.common import (
    add_threads_arg,
    apply_threads,
    device_name,
    engine_config,
    forget_cached_prefixes,
    peak_gpu_memory,
    peak_rss_bytes,
    print_table,
    run_workload,
    serve_one,
    write_json,
)
from pagedllm.bench.scenarios import (
    single_stream_requests,
    stream_one,
    summarize_run,
    summarize_streams,
)
from pagedllm.bench.workload import WORKLOADS, BenchRequest, load_workload, summarize
from pagedllm.config import EngineConfig, add_engine_args, flag_name
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams


def add_args(parser: argparse.ArgumentParser) -> None:
    baselines.add_args(parser)
    add_threads_arg(parser)  # a baseline runs with as many threads as torch
    parser.add_argument("--workload", choices=WORKLOADS, default="default",
                        help="default: what --dataset says; copy: prompts whose answers echo their "
                             "input (edit a passage, refactor code, fill a JSON template), for "
                             "speculative decoding; the single-stream requests are copy ones too")
    parser.add_argument("--single-stream-runs", type=int, default=3,
                        help="requests timed one by one in the single-stream scenario")
    parser.add_argument("--single-stream-len", default="128:256", metavar="PROMPT:OUTPUT",
                        help="prompt and generated tokens of each single-stream request")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the batched workload this many times, in turn with a baseline that "
                             "runs it too (A, B, A, B, ...); rows give each system's median run")
    parser.add_argument("--no-sequential", action="store_true",
                        help="skip the workload run one request at a time (long: minutes)")
    parser.add_argument("--lockstep-with", default=None, metavar="FIELD=VALUE",
                        help="also run the batched workload on a second engine with this engine setting "
                             "changed (e.g. quantization=none), stepped in turn with the first, so load "
                             "on the machine falls on both alike; reports the ratio")
    parser.add_argument("--lockstep-single-stream", action="store_true",
                        help="with --lockstep-with, also serve the single-stream requests one by one on "
                             "both engines in turn (e.g. speculative decoding against the plain engine)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of every request (default 0: greedy; 1 measures "
                             "random sampling, what OpenAI clients that send none get); the hf "
                             "baseline samples alike, the others run greedy only")
    parser.set_defaults(func=main, num_prompts=64, input_len="32-512", output_len="32-256")


def main(args: argparse.Namespace) -> int:
    process_started = psutil.Process().create_time()
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1; got {args.repeats}")
    if (args.lockstep_with or "").partition("=")[0] == "cpu_isa":
        raise ValueError("--lockstep-with cannot change cpu_isa: the kernel tier is chosen once per "
                         "process (pagedllm.kernels.tiers): building a twin at another would switch "
                         "this engine's kernels too; compare tiers in two runs against one "
                         "baseline (--baseline)")
    if args.temperature > 0 and args.baseline not in ("none", "hf"):
        raise ValueError(f"--temperature applies to pagedllm and the hf baseline; the {args.baseline} "
                         "baseline runs greedy only")
    apply_threads(args)
    engine = LLMEngine(engine_config(args))
    serve_one(engine)  # start-up counts until a first request is served, as a user sees it
    startup_s = time.time() - process_started
    rss_mib = round(psutil.Process().memory_info().rss / 2**20, 1)
    workload = load_workload(engine.tokenizer, args.dataset, args.num_prompts, args.input_len,
                             args.output_len, args.seed, args.workload)
    prompt_tokens, output_tokens = (int(n) for n in args.single_stream_len.split(":"))
    streams = single_stream_requests(engine.tokenizer, args.single_stream_runs, prompt_tokens, output_tokens,
                                     args.seed, args.workload)
    baseline = None if args.baseline == "none" else baselines.load(args.baseline)
    session = baseline.start(engine, args, workload + streams) if baseline else None
    ours = {"system": "pagedllm", "dtype": str(engine.dtype).removeprefix("torch."),
            "device": device_name(engine.device), "quantization": engine.config.quantization,
            "batch_invariant": engine.config.batch_invariant,
            "weights_mib": round(engine.weight_bytes / 2**20, 1),
            "startup_s": round(startup_s, 2), "engine_init_s": round(engine.startup_s, 2),
            "rss_after_startup_mib": rss_mib, **cpu_tier_fields(engine.device)}
    payload = {"workload": {**summarize(workload), "kind": args.workload, "temperature": args.temperature},
               "single_stream_len": args.single_stream_len, "pagedllm": ours}
    try:
        rival = session if session is not None and "batched" in baseline.SCENARIOS else None
        results, rival_runs = _batched_runs(engine, rival, workload, args.repeats, args.temperature)
        ours.update(peak_rss_mib=round(peak_rss_bytes() / 2**20, 1),
                    num_preemptions=results[-1].num_preemptions,
                    kv_cache_mib=round(engine.kv_plan.kv_cache_bytes / 2**20, 1),
                    **_median_run([r.rates() for r in results]), **peak_gpu_memory(engine.device))
        if args.lockstep_with:
            forget_cached_prefixes(engine)
            payload["lockstep"] = _lockstep(engine, args, workload,
                                            streams if args.lockstep_single_stream else [])
        if session is not None:
            forget_cached_prefixes(engine)
            payload[baseline.SYSTEM] = _run_baseline(baseline, session, engine, workload, streams, ours, args,
                                                     rival_runs)
            if rival_runs and getattr(session, "token_ids", None):
                payload["same_output"] = _agreement(results[-1].token_ids, session.token_ids)
    finally:
        final = session.close() if session is not None else {}
    if baseline is not None:
        payload[baseline.SYSTEM].update(final)
    _report(payload, baseline.SYSTEM if baseline else None)
    write_json(args.output_json, payload)
    return 0


def _batched_runs(engine: LLMEngine, rival, workload: list[BenchRequest], repeats: int,
                  temperature: float):
    """The workload, all at once, `repeats` times on the engine and, in turn, on rival (a
    baseline session, or None): pagedllm, rival, pagedllm, rival, ... Each run starts with an
    empty prefix cache (the rival's worker empties its own), so no run reuses an earlier one's
    prompts. Returns the engine's RunResults and the rival's rates of each run."""
    results, rival_runs = [], []
    for k in range(repeats):
        forget_cached_prefixes(engine)
        results.append(run_workload(engine, workload, tag=f"bench{k}", temperature=temperature))
        if rival is not None:
            elapsed_s = rival.batched(workload)
            rival_runs.append(summarize_run(elapsed_s, workload, getattr(rival, "cpu_s", None)))
    return results, rival_runs


def _median_run(runs: list[dict]) -> dict:
    """The run of median output tokens/s (the lower middle one of an even count), with every
    run's tokens/s (and tokens per CPU second, where counted) beside it."""
    ranked = sorted(runs, key=lambda r: r["output_tokens_per_s"])
    median = dict(ranked[(len(ranked) - 1) // 2])
    if len(runs) > 1:
        for key in ("output_tokens_per_s", "output_tokens_per_cpu_s"):
            if all(key in r for r in runs):
                median[f"{key}_each"] = [r[key] for r in runs]
    return median


def _agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How far two systems' greedy outputs of the same requests agree: the share identical, and
    the mean length of the common prefix (in bf16 two correct engines part after some tokens)."""
    prefixes = []
    for a, b in zip(ours, theirs, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(n)
    same = sum(a == b for a, b in zip(ours, theirs))
    return {"requests_identical": round(same / len(ours), 3),
            "mean_common_prefix_tokens": round(sum(prefixes) / len(prefixes), 1)}


def _run_baseline(baseline, session, engine: LLMEngine, workload: list[BenchRequest],
                  streams: list[BenchRequest], ours: dict, args, batched_runs: list[dict]) -> dict:
    theirs = {"system": baseline.SYSTEM, **session.info}
    if batched_runs:
        theirs.update(_median_run(batched_runs))
    if "single_stream" in baseline.SCENARIOS:
        ours["single_stream"], theirs["single_stream"] = _interleaved(engine, session, streams)
    if "sequential" in baseline.SCENARIOS and not args.no_sequential:
        mine, rival = _interleaved(engine, session, workload, summarize=False)
        ours["sequential"] = summarize_run(sum(t.ttft_s + t.decode_s for t in mine), workload)
        theirs["sequential"] = summarize_run(sum(t.ttft_s + t.decode_s for t in rival), workload)
    return theirs


def _lockstep(engine: LLMEngine, args, workload: list[BenchRequest], streams: list[BenchRequest]) -> dict:
    """The workload on engine and on a twin with one setting changed, one step of each in turn;
    each engine's time is the sum of its own steps (wall, and the process's CPU time). Then the
    single-stream requests (if any), each served alone by engine and by the twin in turn."""
    field, _, value = args.lockstep_with.partition("=")
    if not hasattr(engine.config, field) or not value:
        raise ValueError(f"--lockstep-with takes FIELD=VALUE naming an engine setting; "
                         f"got {args.lockstep_with!r}")
    twin = LLMEngine(engine_config(args, **{field: _setting(field, getattr(engine.config, field), value)}))
    serve_one(twin)
    engines = {"this": engine, args.lockstep_with: twin}
    for e in engines.values():
        for i, r in enumerate(workload):
            e.add_request(f"lockstep-{i}", {"prompt_token_ids": r.prompt_token_ids},
                          SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True))
    elapsed, cpu = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0.0)
    while any(e.has_unfinished_requests() for e in engines.values()):
        for name, e in engines.items():
            if e.has_unfinished_requests():
                started, started_cpu = time.perf_counter(), time.process_time()
                e.step()
                elapsed[name] += time.perf_counter() - started
                cpu[name] += time.process_time() - started_cpu
    rates = {name: {**summarize_run(seconds, workload), "cpu_s": round(cpu[name], 3)}
             for name, seconds in elapsed.items()}
    result = {**rates, "ratio_output_tokens_per_s": round(
        rates["this"]["output_tokens_per_s"] / rates[args.lockstep_with]["output_tokens_per_s"], 3),
        "ratio_output_tokens_per_cpu_s": round(cpu[args.lockstep_with] / cpu["this"], 3)}
    if streams:
        forget_cached_prefixes(engine)
        mine, twins = _interleaved(engine, _EngineSession(twin), streams)
        ratio = mine["decode_tokens_per_s_median"] / twins["decode_tokens_per_s_median"]
        result["single_stream"] = {"this": mine, args.lockstep_with: twins,
                                   "ratio_decode_tokens_per_s_median": round(ratio, 3)}
    return result


class _EngineSession:
    """A second engine served request by request, as _interleaved serves a baseline."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.served = engine, 0

    def stream(self, request: BenchRequest):
        self.served += 1
        return stream_one(self.engine, request, f"twin-stream-{self.served}")


def _setting(field: str, default, value: str):
    """A --lockstep-with value in the type of the setting's default (true/false for a flag); a
    setting left unset (None, such as block_size: the device's) is read as its flag reads it."""
    if isinstance(default, bool):
        if value.lower() not in ("true", "false"):
            raise ValueError(f"--lockstep-with: a true/false setting; got {value!r}")
        return value.lower() == "true"
    if default is not None:
        return type(default)(value)
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_engine_args(parser)
    (flag,) = [flag_name(f) for f in dataclasses.fields(EngineConfig) if f.name == field]
    try:
        return getattr(parser.parse_args([flag, value]), field)
    except argparse.ArgumentError as exc:
        raise ValueError(f"--lockstep-with {field}={value}: {exc}") from None


def _interleaved(engine: LLMEngine, session, requests: list[BenchRequest], summarize: bool = True):
    """Each request served alone by pagedllm, then by the baseline, in turn."""
    mine, rival = [], []
    for i, request in enumerate(requests):
        mine.append(stream_one(engine, request, f"stream-{i}"))
        rival.append(session.stream(request))
    return (summarize_streams(mine), summarize_streams(rival)) if summarize else (mine, rival)


def cpu_tier_fields(device) -> dict:
    """The CPU kernel tier the engine chose, and each family's kernel (none off the CPU)."""
    from pagedllm.kernels import tiers

    choice = tiers.chosen()
    if device.type != "cpu" or choice is None:
        return {}
    return {"cpu_tier": choice.tier if choice.why_portable is None else "portable",
            "cpu_kernels": choice.describe()}


def _label(system: dict) -> str:
    """A system's name in the tables, with its CPU kernel tier where it has one."""
    return f"{system['system']} ({system['cpu_tier']})" if "cpu_tier" in system else system["system"]


def _report(payload: dict, rival: str | None) -> None:
    ours, theirs = payload["pagedllm"], payload.get(rival, {})
    if "cpu_kernels" in ours:
        print(f"pagedllm's CPU kernels: {ours['cpu_kernels']}")
    ours = {**ours, "system": _label(ours)}
    columns = ("system", "device", "dtype", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
               "elapsed_s", "cpu_s", "output_tokens_per_cpu_s", "startup_s", "peak_rss_mib")
    rows = [[ours.get(c, "-") for c in columns]]
    if "output_tokens_per_s" in theirs:
        rows.append([theirs.get(c, "-") for c in columns])
        # (ratio key, its run by run key, the rows' key)
        for ratio, each_run, key in (("ratio_output_tokens_per_s", "ratio_each_run", "output_tokens_per_s"),
                                     ("ratio_output_tokens_per_cpu_s", "ratio_per_cpu_s_each_run",
                                      "output_tokens_per_cpu_s")):
            if key in ours and key in theirs:
                payload[ratio] = round(ours[key] / theirs[key], 2)
            if f"{key}_each" in ours and f"{key}_each" in theirs:  # run by run, in the order they ran
                pairs = zip(ours[f"{key}_each"], theirs[f"{key}_each"])
                payload[each_run] = [round(a / b, 2) for a, b in pairs]
    print_table(f"Offline throughput, all requests at once: {payload['workload']}",
                ["system", "device", "dtype", "req/s", "out tok/s", "total tok/s", "time s", "CPU s",
                 "out tok / CPU s", "start-up s", "peak RSS MiB"], rows)
    if "ratio_output_tokens_per_s" in payload:
        print(f"\npagedllm / {rival} generated tokens/s: {payload['ratio_output_tokens_per_s']}x")
    if "ratio_each_run" in payload:
        print(f"each pair of runs: {payload['ratio_each_run']} (tok/s: pagedllm "
              f"{ours['output_tokens_per_s_each']}, {rival} {theirs['output_tokens_per_s_each']})")
    if "ratio_output_tokens_per_cpu_s" in payload:
        each = payload.get("ratio_per_cpu_s_each_run")
        print(f"per CPU second (every process of each system): {payload['ratio_output_tokens_per_cpu_s']}x"
              + (f", each pair of runs: {each}" if each else ""))
    if "same_output" in payload:
        same = payload["same_output"]
        print(f"greedy outputs identical to {rival}'s: {same['requests_identical']:.0%} of requests; "
              f"common prefix {same['mean_common_prefix_tokens']} tokens on average")
    if "lockstep" in payload:
        lockstep = payload["lockstep"]
        print_table("The same workload on a twin engine, steps in turn",
                    ["engine", "out tok/s", "total tok/s", "time s", "CPU s"],
                    [[name, r["output_tokens_per_s"], r["total_tokens_per_s"], r["elapsed_s"], r["cpu_s"]]
                     for name, r in lockstep.items() if isinstance(r, dict) and name != "single_stream"])
        print(f"\nthis engine / the twin, generated tokens/s: {lockstep['ratio_output_tokens_per_s']}x "
              f"(per CPU second: {lockstep['ratio_output_tokens_per_cpu_s']}x)")
        if "single_stream" in lockstep:
            single = lockstep["single_stream"]
            print_table("Single stream on both engines, one request at a time (each run: this, the twin)",
                        ["engine", "decode tok/s best", "median", "each run", "TTFT ms median"],
                        [[name, s["decode_tokens_per_s_best"], s["decode_tokens_per_s_median"],
                          s["decode_tokens_per_s_each"], s["ttft_ms_median"]]
                         for name, s in single.items() if isinstance(s, dict)])
            print(f"\nthis engine / the twin, single-stream decode tok/s (medians): "
                  f"{single['ratio_decode_tokens_per_s_median']}x")
    if "single_stream" in theirs:
        print_table(f"Single stream: {payload['single_stream_len']} tokens (prompt:generated), one "
                    "request at a time (each run: pagedllm, then the baseline)",
                    ["system", "decode tok/s best", "median", "each run", "decode CPU ms/token median",
                     "TTFT ms best", "median", "RSS after load MiB"],
                    [[s["system"], s["single_stream"]["decode_tokens_per_s_best"],
                      s["single_stream"]["decode_tokens_per_s_median"],
                      s["single_stream"]["decode_tokens_per_s_each"],
                      s["single_stream"].get("decode_cpu_ms_per_token_median", "-"),
                      s["single_stream"]["ttft_ms_best"], s["single_stream"]["ttft_ms_median"],
                      s.get("rss_after_startup_mib", s.get("rss_mib", "-"))] for s in (ours, theirs)])
        mine, rivals = ours["single_stream"], theirs["single_stream"]
        payload["ratio_single_stream_decode_median"] = round(
            mine["decode_tokens_per_s_median"] / rivals["decode_tokens_per_s_median"], 3)
        pairs = [round(a / b, 2) for a, b in zip(mine["decode_tokens_per_s_each"],
                                                  rivals["decode_tokens_per_s_each"])]
        payload["ratio_single_stream_each_run"] = pairs
        print(f"\npagedllm / {rival} single-stream decode tok/s (medians): "
              f"{payload['ratio_single_stream_decode_median']}x; each pair of runs: {pairs}")
    if "sequential" in theirs:
        print_table("The workload one request at a time (in turn with the baseline)",
                    ["system", "out tok/s", "total tok/s", "time s"],
                    [[s["system"], s["sequential"]["output_tokens_per_s"],
                      s["sequential"]["total_tokens_per_s"], s["sequential"]["elapsed_s"]]
                     for s in (ours, theirs)])
