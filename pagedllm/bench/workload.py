"""Benchmark workloads shared by every bench: the same requests for every system compared.

`random`: prompt and output lengths drawn uniformly from ranges with a seed; prompt tokens are
cut from a real English corpus shipped with the package (pagedllm/data/corpus.txt: the Python
standard library's documentation strings, PSF license), never random ids. A `.jsonl` file gives
one {"prompt": ..., "max_tokens": ...} per line.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def parse_range(text: str | int) -> tuple[int, int]:
    """"32-512" -> (32, 512); "128" -> (128, 128)."""
    low, _, high = str(text).partition("-")
    lo, hi = int(low), int(high or low)
    if lo < 1 or hi < lo:
        raise ValueError(f"a length range must look like 32-512 with 1 <= low <= high; got {text!r}")
    return lo, hi


def corpus_text() -> str:
    return resources.files("pagedllm").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def random_workload(tokenizer, num_requests: int, input_len: str | int, output_len: str | int,
                    seed: int = 0) -> list[BenchRequest]:
    in_lo, in_hi = parse_range(input_len)
    out_lo, out_hi = parse_range(output_len)
    corpus_ids = tokenizer.encode(corpus_text(), add_special_tokens=False)
    if len(corpus_ids) <= in_hi:
        raise ValueError(f"the corpus has {len(corpus_ids)} tokens; prompts of {in_hi} need more")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        length = rng.randint(in_lo, in_hi)
        start = rng.randrange(0, len(corpus_ids) - length)
        requests.append(BenchRequest(corpus_ids[start:start + length], rng.randint(out_lo, out_hi)))
    return requests


def file_workload(tokenizer, path: str | Path, num_requests: int | None = None) -> list[BenchRequest]:
    requests = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                prompt, max_tokens = item["prompt"], int(item.get("max_tokens", 128))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: expected {{\"prompt\": ..., \"max_tokens\": ...}}: "
                                 f"{exc}") from exc
            requests.append(BenchRequest(tokenizer.encode(prompt), max_tokens))
            if num_requests is not None and len(requests) >= num_requests:
                break
    if not requests:
        raise ValueError(f"{path} holds no requests")
    return requests


def load_workload(tokenizer, dataset: str, num_requests: int, input_len, output_len,
                  seed: int) -> list[BenchRequest]:
    if dataset == "random":
        return random_workload(tokenizer, num_requests, input_len, output_len, seed)
    return file_workload(tokenizer, dataset, num_requests)


def summarize(requests: list[BenchRequest]) -> dict:
    return {"num_requests": len(requests),
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
            "output_tokens": sum(r.max_tokens for r in requests)}
