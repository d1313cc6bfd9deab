"""Run vLLM's offline `LLM.generate` for `bench throughput --baseline vllm`.

Run by that interpreter, in its own venv: this file imports only the standard library and vllm,
never pagedllm. It speaks JSON lines on a private copy of its stdout (vLLM logs to stdout, and
its engine-core process inherits it, so file descriptor 1 is pointed at stderr before vllm is
imported):
  in:  {"model": PATH, "dtype": "bfloat16", "max_model_len": N, "seed": N}
  out: {"ready": true, "load_s", "rss_after_startup_mib", "version"}
  in:  {"requests": [{"prompt_token_ids": [...], "max_tokens": N}, ...]}
  out: {"elapsed_s", "cpu_s", "token_ids": [[...], ...]}   (every request at once, one generate call)
and at the end of its input answers {"done": true, "peak_rss_mib"} and exits. Memory and CPU time
are summed over its processes (vLLM runs its engine core and its model worker in processes of
their own; the engine core waits for the worker by polling, which counts too).
Greedy decoding, exactly max_tokens tokens (EOS ignored); the prefix cache is emptied before each
run, so no run reuses another's prompts.
"""

import json
import os
import sys
import time


def process_tree() -> list[int]:
    """This process and its descendants (vLLM runs its engine core and model worker apart)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [os.getpid()]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def tree_memory_mib(field: str) -> float:
    """A /proc status field (VmRSS now, VmHWM the peak) summed over the process tree, MiB."""
    total = 0
    for pid in process_tree():
        try:
            with open(f"/proc/{pid}/status") as status:
                total += next((int(line.split()[1]) for line in status if line.startswith(field + ":")), 0)
        except OSError:
            continue
    return round(total / 1024, 1)


def tree_cpu_s() -> float:
    """User and system CPU seconds of the process tree's live processes so far."""
    ticks = 0
    for pid in process_tree():
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return ticks / os.sysconf("SC_CLK_TCK")


def private_stdout():
    """A text stream on the original stdout; fd 1 (and Python's sys.stdout) now go to stderr."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return replies


def generate(llm, vllm, requests: list[dict]) -> dict:
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [vllm.SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], min_tokens=r["max_tokens"],
                                  ignore_eos=True) for r in requests]
    llm.reset_prefix_cache()
    started, started_cpu = time.perf_counter(), tree_cpu_s()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed, cpu_s = time.perf_counter() - started, tree_cpu_s() - started_cpu
    return {"elapsed_s": elapsed, "cpu_s": cpu_s,
            "token_ids": [list(o.outputs[0].token_ids) for o in outputs]}


def main() -> int:
    replies = private_stdout()
    config = json.loads(sys.stdin.readline())
    started = time.perf_counter()
    import vllm

    llm = vllm.LLM(model=config["model"], dtype=config["dtype"], max_model_len=config["max_model_len"],
                   seed=config["seed"])
    # One tiny request first: one-off costs (compilation of a new shape, first allocations) are
    # paid here, as pagedllm pays its own before a measurement.
    generate(llm, vllm, [{"prompt_token_ids": [1, 2, 3], "max_tokens": 2}])
    ready = {"ready": True, "load_s": round(time.perf_counter() - started, 2),
             "rss_after_startup_mib": tree_memory_mib("VmRSS"), "version": vllm.__version__}
    print(json.dumps(ready), file=replies)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(generate(llm, vllm, json.loads(line)["requests"])), file=replies)
    print(json.dumps({"done": True, "peak_rss_mib": tree_memory_mib("VmHWM")}), file=replies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
