"""Serve requests with llama.cpp (llama-cpp-python) for `bench throughput --baseline llama.cpp`.

Run by that interpreter, in its own venv: this file imports only the standard library and
llama_cpp, never pagedllm. It speaks JSON lines on stdin / stdout:
  in:  {"model": PATH, "threads": N, "n_ctx": N, "prompt_lookup": K or null}
                                                    out: {"ready": true, "load_s", "rss_mib", ...}
  in:  {"prompt_token_ids": [...], "max_tokens": N} out: {"ttft_s", "decode_s", "decode_cpu_s", "token_ids"}
and exits at the end of its input. Greedy decoding, exactly max_tokens tokens (EOS ignored).
prompt_lookup K: llama-cpp-python's prompt-lookup speculation (LlamaPromptLookupDecoding, K tokens
proposed from the prompt and output so far), llama.cpp's answer to pagedllm's n-gram proposer.
"""

import json
import resource
import sys
import time


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s() -> float:
    """CPU time of this process so far, all its threads (llama.cpp's workers included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def serve(llm, request: dict) -> dict:
    llm.reset()  # no reuse of the previous request's KV cache: every request prefills its prompt
    started = time.perf_counter()
    first = first_cpu = None
    tokens = []
    for token in llm.generate(request["prompt_token_ids"], top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                              repeat_penalty=1.0):
        if first is None:
            first, first_cpu = time.perf_counter(), cpu_s()
        tokens.append(token)
        if len(tokens) == request["max_tokens"]:
            break
    ended = time.perf_counter()
    return {"ttft_s": first - started, "decode_s": ended - first, "decode_cpu_s": cpu_s() - first_cpu,
            "token_ids": tokens}


def main() -> int:
    import llama_cpp

    config = json.loads(sys.stdin.readline())
    started = time.perf_counter()
    draft = None
    if config.get("prompt_lookup"):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=config["prompt_lookup"])
    llm = llama_cpp.Llama(model_path=config["model"], n_ctx=config["n_ctx"], n_threads=config["threads"],
                          n_threads_batch=config["threads"], n_batch=512, verbose=False, draft_model=draft)
    ready = {"ready": True, "load_s": time.perf_counter() - started, "rss_mib": rss_mib(),
             "version": llama_cpp.__version__}
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(serve(llm, json.loads(line))), flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"done": True, "peak_rss_mib": peak, "rss_mib": rss_mib()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
