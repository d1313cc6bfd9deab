"""`pagedllm bench structured`: what a grammar constraint costs per decode step, without a model.

For a JSON schema, a regex and a choice, N matchers (1, 16, 64 by default) each walk their own
valid answer, one token per step, as N constrained requests of one decode step would. Each step
is timed in its parts: filling the N bitmask rows (a Python loop over the matchers on even
steps, the BitmaskFiller on odd ones, so load falls on both alike), applying
the bitmask to [N, vocab] logits, and accepting the N sampled tokens. Put the sum next to a
decode step of the same batch (docs/benchmarks-notebook.md: 88 ms for 64 SmolLM2 requests on 2 cores).
Compile time (the first request with a new spec) is reported per kind.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from pagedllm.bench.common import add_threads_arg, apply_threads, print_table, write_json
from pagedllm.structured.bitmask import allocate_token_bitmask, apply_token_bitmask_
from pagedllm.structured.compiler import GrammarCompiler
from pagedllm.structured.matcher import BitmaskFiller, GrammarMatcher
from pagedllm.structured.spec import GrammarSpec
from pagedllm.text.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.(com|org)$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": False},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "email", "role", "tags", "address", "score"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]+ [A-Z][a-z]+, [0-9]{1,3} years old, email: [a-z]+@[a-z]+\.(com|org)"
CHOICES = ["positive", "negative", "neutral"]
SPECS = {"json": GrammarSpec.json_schema(SCHEMA), "regex": GrammarSpec.regex(REGEX),
         "choice": GrammarSpec.choice(CHOICES)}
_NAMES = ["Ada Lovelace", "Grace Hopper", "Alan Turing", "Edsger Dijkstra", "Barbara Liskov",
          "Donald Knuth", "Frances Allen", "Ken Thompson", "Margaret Hamilton", "John Backus"]


def answer(kind: str, i: int) -> str:
    """The i-th valid answer of a kind: matchers walk different paths through the grammar."""
    first, last = _NAMES[i % len(_NAMES)].split()
    if kind == "json":
        return json.dumps({
            "name": f"{first} {last}", "age": (17 * i) % 150,
            "email": f"{first.lower()}@{last.lower()}.{'com' if i % 2 else 'org'}",
            "role": ["admin", "user", "guest"][i % 3], "tags": [last.lower()] * (i % 5),
            "address": {"street": f"{i} {last} Road", "city": first, "zip": f"{10000 + 7 * i}"},
            "score": round((i * 0.137) % 1, 3)})
    if kind == "regex":
        return f"{first} {last}, {(13 * i) % 120} years old, email: {first.lower()}@{last.lower()}.org"
    return CHOICES[i % len(CHOICES)]


@dataclass
class StepCost:
    kind: str
    matchers: int
    steps: int
    compile_ms: float  # the kind's first compile; later batch sizes find it cached
    fill_loop_ms: float  # mean per (even) step: one fill_bitmask call per matcher
    fill_batched_ms: float  # mean per (odd) step: BitmaskFiller (the pool past MIN_PARALLEL)
    apply_ms: float  # mean per step: apply_token_bitmask_ on [matchers, vocab] float32 logits
    accept_ms: float  # mean per step: accept_token for each matcher

    @property
    def total_ms(self) -> float:
        return self.fill_batched_ms + self.apply_ms + self.accept_ms


class _Walker:
    """One matcher walking answers of its kind, one token a step, starting over at each end."""

    def __init__(self, matcher: GrammarMatcher, tokenizer: Tokenizer, kind: str, first: int,
                 stride: int):
        self.matcher, self._tokenizer, self._kind = matcher, tokenizer, kind
        self._next, self._stride = first, stride
        self._queue: list[int] = []

    def prepare(self) -> None:
        """Before a step (untimed): at the end of an answer, reset and tokenize the next one."""
        if not self._queue:
            if self.matcher.num_tokens:
                self.matcher.reset()
            self._queue = self._tokenizer.encode(answer(self._kind, self._next), add_special_tokens=False)
            self._next += self._stride

    def take(self) -> int:
        return self._queue.pop(0)


def measure(compiler: GrammarCompiler, tokenizer: Tokenizer, kind: str, num_matchers: int,
            steps: int, filler: BitmaskFiller) -> StepCost:
    """Even steps fill the bitmask with the loop, odd ones with the filler (filling twice in one
    state would time llguidance's cache the second time)."""
    started = time.perf_counter()
    grammar = compiler.compile(SPECS[kind])
    compile_ms = (time.perf_counter() - started) * 1e3
    walkers = [_Walker(grammar.matcher(), tokenizer, kind, i, num_matchers) for i in range(num_matchers)]
    bitmask = allocate_token_bitmask(num_matchers, compiler.vocab_size)
    logits = torch.randn(num_matchers, compiler.vocab_size)
    rows = [(w.matcher, i) for i, w in enumerate(walkers)]
    times: dict[str, list[float]] = {"loop": [], "batched": [], "apply": [], "accept": []}
    for step in range(steps):
        for walker in walkers:
            walker.prepare()
        t0 = time.perf_counter()
        if step % 2 == 0:
            for matcher, row in rows:
                matcher.fill_bitmask(bitmask, row)
        else:
            filler.fill(bitmask, rows)
        t1 = time.perf_counter()
        apply_token_bitmask_(logits, bitmask, compiler.vocab_size)
        t2 = time.perf_counter()
        for walker in walkers:
            if not walker.matcher.accept_token(walker.take()):
                raise RuntimeError(f"{kind}: the grammar refused a valid answer: {walker.matcher.error}")
        t3 = time.perf_counter()
        times["loop" if step % 2 == 0 else "batched"].append((t1 - t0) * 1e3)
        times["apply"].append((t2 - t1) * 1e3)
        times["accept"].append((t3 - t2) * 1e3)
    mean = {name: round(statistics.fmean(values), 4) for name, values in times.items()}
    return StepCost(kind, num_matchers, steps, round(compile_ms, 2), mean["loop"], mean["batched"],
                    mean["apply"], mean["accept"])


def run(tokenizer: Tokenizer, kinds: list[str], batch_sizes: list[int], steps: int,
        pool_threads: int = 1) -> list[StepCost]:
    compiler = GrammarCompiler(tokenizer)
    filler = BitmaskFiller(pool_threads)
    try:
        return [measure(compiler, tokenizer, kind, n, steps, filler)
                for kind in kinds for n in batch_sizes]
    finally:
        compiler.close()


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kinds", default="json,regex,choice", help="json, regex, choice")
    parser.add_argument("--batch-sizes", default="1,16,64", help="concurrent matchers")
    parser.add_argument("--steps", type=int, default=200, help="decode steps timed per case")
    parser.add_argument("--pool-threads", type=int, default=1,
                        help="threads of llguidance's pool for the filler (1: the filler loops)")
    add_threads_arg(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from pagedllm.model.tokenizer_files import load_tokenizer

    apply_threads(args)
    kinds = [k.strip() for k in args.kinds.split(",")]
    unknown = set(kinds) - set(SPECS)
    if unknown:
        raise ValueError(f"unknown kinds {sorted(unknown)}; use {', '.join(SPECS)}")
    sizes = [int(n) for n in args.batch_sizes.split(",")]
    results = run(load_tokenizer(args.model), kinds, sizes, args.steps, args.pool_threads)
    header = ["kind", "matchers", "compile ms", "fill loop ms", "fill batched ms", "apply ms",
              "accept ms", "total ms/step"]
    print_table("grammar cost per decode step (means)", header, [
        [r.kind, r.matchers, r.compile_ms, r.fill_loop_ms, r.fill_batched_ms, r.apply_ms,
         r.accept_ms, round(r.total_ms, 3)] for r in results])
    write_json(args.output_json, {"results": [asdict(r) | {"total_ms": r.total_ms} for r in results]})
    return 0
