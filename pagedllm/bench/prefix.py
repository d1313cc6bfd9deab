"""`pagedllm bench prefix`: what sharing KV blocks buys.

(a) multi-turn chat: time to first token of turns 2..k with and without prefix caching;
(b) many requests behind one long shared system prompt: tokens computed and throughput with
    and without; (c) peak KV blocks for n=4 against 4 separate requests, and for beam width 4
    against 4 independent sequences.
"""

from __future__ import annotations

import argparse
import time

from pagedllm.bench.common import engine_config, print_table, write_json
from pagedllm.bench.workload import corpus_text
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--turn-tokens", type=int, default=200, help="tokens per user turn (a)")
    parser.add_argument("--system-tokens", type=int, default=1024, help="shared system prompt (b)")
    parser.add_argument("--shared-requests", type=int, default=32, help="requests behind it (b)")
    parser.set_defaults(func=main, num_prompts=0, input_len="0", output_len="0")


def main(args: argparse.Namespace) -> int:
    results = {}
    for caching in (False, True):
        engine = LLMEngine(engine_config(args, enable_prefix_caching=caching))
        key = "with_caching" if caching else "without_caching"
        results[key] = {"multi_turn": multi_turn(engine, args), "shared_system": shared_system(engine, args)}
        del engine
    engine = LLMEngine(engine_config(args, enable_prefix_caching=False))
    results["sharing"] = sharing_peaks(engine)
    _print(results)
    write_json(args.output_json, results)
    return 0


def _text_chunks(tokenizer, size: int, count: int, offset: int = 0) -> list[str]:
    ids = tokenizer.encode(corpus_text(), add_special_tokens=False)
    return [tokenizer.decode(ids[offset + i * size: offset + (i + 1) * size]) for i in range(count)]


def _run_one(engine: LLMEngine, request_id: str, prompt, params: SamplingParams) -> tuple[float, str]:
    """Time to first token and final text of one request run alone."""
    started = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    ttft, text = None, ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            if ttft is None and output.outputs[0].token_ids:
                ttft = time.perf_counter() - started
            text = output.outputs[0].text
    return ttft or 0.0, text


def multi_turn(engine: LLMEngine, args) -> dict:
    """A conversation growing turn by turn; each turn resends the whole history."""
    tokenizer = engine.tokenizer
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ttfts, lengths = [], []
    for turn, chunk in enumerate(_text_chunks(tokenizer, args.turn_tokens, args.turns)):
        messages.append({"role": "user", "content": f"Summarize this:\n{chunk}"})
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        request_id = f"turn-{turn}-{time.monotonic_ns()}"
        ttft, reply = _run_one(engine, request_id, {"prompt_token_ids": ids}, params)
        messages.append({"role": "assistant", "content": reply})
        ttfts.append(round(ttft * 1000, 1))
        lengths.append(len(ids))
    return {"ttft_ms": ttfts, "prompt_tokens": lengths}


def shared_system(engine: LLMEngine, args) -> dict:
    tokenizer = engine.tokenizer
    system = _text_chunks(tokenizer, args.system_tokens, 1)[0]
    questions = _text_chunks(tokenizer, 24, args.shared_requests, offset=args.system_tokens)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    computed_before = engine.stats().num_computed_tokens
    started = time.perf_counter()
    for i, q in enumerate(questions):
        engine.add_request(f"shared-{i}-{time.monotonic_ns()}", system + "\n\n" + q, params)
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - started
    computed = engine.stats().num_computed_tokens - computed_before
    return {"requests": len(questions), "tokens_computed": computed,
            "elapsed_s": round(elapsed, 2), "requests_per_s": round(len(questions) / elapsed, 3)}


def _peak_blocks(engine: LLMEngine, run) -> int:
    """The most KV blocks in use during any step while run's requests went through."""
    peak = 0
    run()
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.stats().step_num_used_blocks)
    return peak


def sharing_peaks(engine: LLMEngine) -> dict:
    from pagedllm.entrypoints.beam_search import BeamSearch

    tokenizer = engine.tokenizer
    prompt = tokenizer.encode(_text_chunks(tokenizer, 300, 1)[0], add_special_tokens=False)
    sample = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=0)
    n4 = _peak_blocks(engine, lambda: engine.add_request("n4", {"prompt_token_ids": prompt},
                                                         SamplingParams(**{**_fields(sample), "n": 4})))

    def four_separate():
        for i in range(4):
            engine.add_request(f"sep-{i}", {"prompt_token_ids": prompt}, sample)

    separate = _peak_blocks(engine, four_separate)
    beam = BeamSearch(engine.engine_core, tokenizer, beam_width=4, max_tokens=64)
    beam.run([prompt])
    return {"prompt_tokens": len(prompt), "output_tokens": 64, "block_size": engine.kv_plan.block_size,
            "n4_peak_blocks": n4, "four_separate_peak_blocks": separate,
            "beam4_peak_blocks": beam.peak_blocks_used, "four_independent_peak_blocks": separate,
            "n4_saving_pct": round(100 * (1 - n4 / separate), 1),
            "beam4_saving_pct": round(100 * (1 - beam.peak_blocks_used / separate), 1)}


def _fields(params: SamplingParams) -> dict:
    return {k: getattr(params, k) for k in ("temperature", "max_tokens", "ignore_eos", "seed")}


def _print(r: dict) -> None:
    off, on = r["without_caching"], r["with_caching"]
    turns = zip(on["multi_turn"]["prompt_tokens"], off["multi_turn"]["ttft_ms"], on["multi_turn"]["ttft_ms"])
    rows = [[f"turn {i + 1}", tokens, a, b, round(a / b, 1) if b else "-"]
            for i, (tokens, a, b) in enumerate(turns)]
    print_table("(a) multi-turn chat: time to first token (ms)",
                ["turn", "prompt tokens", "no cache", "prefix cache", "speed-up"], rows)
    rows = [[name, x["shared_system"]["tokens_computed"], x["shared_system"]["requests_per_s"],
             x["shared_system"]["elapsed_s"]] for name, x in (("no cache", off), ("prefix cache", on))]
    print_table("(b) one long shared system prompt", ["", "tokens computed", "req/s", "time s"],
                rows)
    s = r["sharing"]
    rows = [["n=4 (fork)", s["n4_peak_blocks"], s["four_separate_peak_blocks"], f"{s['n4_saving_pct']}%"],
            ["beam width 4", s["beam4_peak_blocks"], s["four_independent_peak_blocks"],
             f"{s['beam4_saving_pct']}%"]]
    print_table(f"(c) peak KV blocks, prompt {s['prompt_tokens']} + {s['output_tokens']} tokens",
                ["", "shared", "4 separate", "saved"], rows)
