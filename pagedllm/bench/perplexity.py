"""Perplexity of a model on a text, read through the paged KV cache: the quality yardstick for
anything that changes the numbers a model computes with (compressed KV pages, quantized weights).

The text is cut into windows of `context_len` tokens; each window is prefilled in chunks of
`chunk_len` tokens, so every chunk after the first attends to K/V read back from the cache (in
whatever dtype the cache stores) exactly as a served request would. The score is exp of the mean
negative log-likelihood of every token after the first of each window.

The held-out text (pagedllm/data/heldout.txt) is the GNU GPL version 3, whose licence allows
verbatim copies: English prose unlike the bench prompts' corpus (Python docstrings), so nothing
is tuned on it.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass
from importlib import resources

import torch

from pagedllm.kernels.attention import AttentionMetadata
from pagedllm.utils import cdiv


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float
    num_scored_tokens: int


def heldout_text() -> str:
    return resources.files("pagedllm").joinpath("data/heldout.txt").read_text(encoding="utf-8")


@torch.inference_mode()
def perplexity(model, kv_caches, block_size: int, token_ids: list[int], *, context_len: int = 1024,
               chunk_len: int = 256) -> PerplexityResult:
    """Perplexity of token_ids under model, whose attention reads and writes kv_caches (one
    (key, value) pair per layer with at least ceil(context_len / block_size) blocks)."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    total_nll, scored = 0.0, 0
    for start in range(0, len(token_ids) - 1, context_len):
        window = token_ids[start:start + context_len]
        if len(window) < 2:
            break
        nll = _window_nll(model, kv_caches, block_size, window, chunk_len)
        total_nll += nll
        scored += len(window) - 1
    mean = total_nll / scored
    return PerplexityResult(math.exp(mean), mean, scored)


def _window_nll(model, kv_caches, block_size: int, window: list[int], chunk_len: int) -> float:
    """Summed NLL of window[1:], one request prefilled chunk by chunk into blocks 0, 1, 2, ..."""
    num_blocks = cdiv(len(window), block_size)
    if num_blocks > kv_caches[0][0].shape[0]:
        raise ValueError(f"a window of {len(window)} tokens needs {num_blocks} blocks; the cache "
                         f"has {kv_caches[0][0].shape[0]}")
    block_table = torch.arange(num_blocks, dtype=torch.int32).unsqueeze(0)
    nll = 0.0
    for lo in range(0, len(window), chunk_len):
        hi = min(lo + chunk_len, len(window))
        positions = torch.arange(lo, hi)
        meta = AttentionMetadata(
            slot_mapping=positions.clone(), block_tables=block_table,
            seq_lens=torch.tensor([hi], dtype=torch.int32),
            query_start_loc=torch.tensor([0, hi - lo], dtype=torch.int32),
            seq_lens_cpu=[hi], query_start_loc_cpu=[0, hi - lo])
        hidden = model(torch.tensor(window[lo:hi]), positions, kv_caches, meta)
        targets = torch.tensor(window[lo + 1:hi + 1])  # the last chunk has one target fewer
        logits = model.compute_logits(hidden[:len(targets)])
        nll -= torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None]).sum().item()
    return nll


def add_args(parser: argparse.ArgumentParser) -> None:
    from pagedllm.bench.common import add_threads_arg

    parser.add_argument("--context-len", type=int, default=1024, help="tokens per scored window")
    parser.add_argument("--chunk-len", type=int, default=256, help="tokens per prefill chunk")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="score only the text's first tokens (default: all of it)")
    add_threads_arg(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """`pagedllm bench perplexity`: the engine's model and KV cache, as configured by the engine
    flags (dtype, --quantization, the KV cache), on the held-out text."""
    from pagedllm.bench.common import apply_threads, engine_config, write_json
    from pagedllm.engine.llm_engine import LLMEngine

    apply_threads(args)
    engine = LLMEngine(engine_config(args, max_model_len=args.context_len))
    token_ids = engine.tokenizer.encode(heldout_text(), add_special_tokens=False)[:args.max_tokens]
    started = time.perf_counter()
    runner = engine.engine_core.executor.runner
    result = perplexity(runner.model, runner.kv_caches, engine.kv_plan.block_size, token_ids,
                        context_len=args.context_len, chunk_len=args.chunk_len)
    payload = {"model": str(engine.model_path), "dtype": str(engine.dtype).removeprefix("torch."),
               "quantization": engine.config.quantization, "weights": engine.weights_note,
               "weight_bytes": engine.weight_bytes, **asdict(result),
               "elapsed_s": round(time.perf_counter() - started, 1)}
    print(f"perplexity {result.perplexity:.4f} over {result.num_scored_tokens} tokens "
          f"({payload['dtype']}, quantization {payload['quantization']}: {payload['weights']})")
    write_json(args.output_json, payload)
    return 0
