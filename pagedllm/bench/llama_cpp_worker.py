"""Serve requests with llama.cpp (llama-cpp-python) for `bench throughput --baseline llama.cpp`.

Run by that interpreter, in its own venv: this file imports only the standard library,
llama_cpp and numpy (llama-cpp-python's own dependency), never pagedllm. It speaks JSON lines
on stdin / stdout:
  in:  {"model": PATH, "threads": N, "n_ctx": N, "prompt_lookup": K or null}
                                                    out: {"ready": true, "load_s", "rss_mib", ...}
  in:  {"prompt_token_ids": [...], "max_tokens": N} out: {"ttft_s", "decode_s", "decode_cpu_s", "token_ids"}
  in:  {"requests": [{"prompt_token_ids", "max_tokens"}, ...]}
                                                    out: {"elapsed_s", "cpu_s", "token_ids": [[...], ...]}
and exits at the end of its input. Greedy decoding, exactly max_tokens tokens (EOS ignored).
prompt_lookup K: llama-cpp-python's prompt-lookup speculation (LlamaPromptLookupDecoding, K tokens
proposed from the prompt and output so far), llama.cpp's answer to pagedllm's n-gram proposer.
"""

import json
import resource
import sys
import time

N_BATCH = 512  # tokens a llama_decode call takes at most (prompt chunks and next tokens together)


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


def batched(llm, requests: list[dict], threads: int) -> dict:
    """Every request at once, as llama-server's parallel slots serve them: continuous batching
    through llama.cpp's C API, one sequence id per request, each with its own KV cells (faster
    than one unified cache here: 103 against 95 tok/s for 16 streams of the default model on
    ep-2c), each step the running sequences' next tokens first, then prompt tokens up to the
    batch's size; greedy."""
    import llama_cpp as C
    import numpy as np

    params = C.llama_context_default_params()
    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in requests)
    params.n_ctx = len(requests) * (longest + 64)  # every sequence's cells: n_ctx / n_seq_max
    params.n_batch = params.n_ubatch = N_BATCH
    params.n_seq_max = len(requests)
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = False
    ctx = C.llama_init_from_model(llm._model.model, params)
    batch = C.llama_batch_init(N_BATCH, 0, 1)
    n_vocab = llm.n_vocab()
    prompts = [r["prompt_token_ids"] for r in requests]
    fed = [0] * len(requests)  # prompt tokens in the cache
    outputs: list[list[int]] = [[] for _ in requests]
    started, started_cpu = time.perf_counter(), cpu_s()
    try:
        while True:
            rows = []  # (request, row in the batch) whose logits give a token
            batch.n_tokens = 0
            for i, out in enumerate(outputs):
                if out and len(out) < requests[i]["max_tokens"]:
                    rows.append((i, _add(batch, out[-1], len(prompts[i]) + len(out) - 1, i, True)))
            for i, prompt in enumerate(prompts):
                while fed[i] < len(prompt) and batch.n_tokens < N_BATCH:
                    last = fed[i] == len(prompt) - 1
                    row = _add(batch, prompt[fed[i]], fed[i], i, last)
                    fed[i] += 1
                    if last:
                        rows.append((i, row))
            if not batch.n_tokens:
                break
            if C.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for i, row in rows:
                logits = np.ctypeslib.as_array(C.llama_get_logits_ith(ctx, row), shape=(n_vocab,))
                outputs[i].append(int(logits.argmax()))
        return {"elapsed_s": time.perf_counter() - started, "cpu_s": cpu_s() - started_cpu,
                "token_ids": outputs}
    finally:
        C.llama_batch_free(batch)
        C.llama_free(ctx)


def _add(batch, token: int, position: int, seq_id: int, logits: bool) -> int:
    row = batch.n_tokens
    batch.token[row], batch.pos[row] = token, position
    batch.seq_id[row][0], batch.n_seq_id[row] = seq_id, 1
    batch.logits[row] = logits
    batch.n_tokens = row + 1
    return row


def main() -> int:
    import llama_cpp

    config = json.loads(sys.stdin.readline())
    started = time.perf_counter()
    draft = None
    if config.get("prompt_lookup"):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=config["prompt_lookup"])
    llm = llama_cpp.Llama(model_path=config["model"], n_ctx=config["n_ctx"], n_threads=config["threads"],
                          n_threads_batch=config["threads"], n_batch=N_BATCH, verbose=False,
                          draft_model=draft)
    ready = {"ready": True, "load_s": time.perf_counter() - started, "rss_mib": rss_mib(),
             "version": llama_cpp.__version__}
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        if line.strip():
            request = json.loads(line)
            reply = (batched(llm, request["requests"], config["threads"]) if "requests" in request
                     else serve(llm, request))
            print(json.dumps(reply), flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"done": True, "peak_rss_mib": peak, "rss_mib": rss_mib()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
