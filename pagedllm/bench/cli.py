"""`pagedllm bench {memory,throughput,scheduler,...}`."""

from __future__ import annotations

import argparse
import importlib

from pagedllm.config import add_engine_args

# name -> (module, help); each module has add_args(parser) that sets `func`.
BENCHES = {
    "memory": ("pagedllm.bench.memory", "KV waste and concurrency: paged against contiguous"),
    "throughput": ("pagedllm.bench.throughput",
                   "offline throughput, start-up, RSS; --baseline hf, llama.cpp or vllm, same requests"),
    "serve": ("pagedllm.bench.serve", "load a running server: throughput, TTFT, TPOT, ITL, latency"),
    "attention": ("pagedllm.bench.attention",
                  "the price of paging: attention over paged blocks vs contiguous KV, and prepare_inputs"),
    "block-size": ("pagedllm.bench.block_size",
                   "sweep block sizes on one workload: waste, throughput, attention time share"),
    "kv-dtype": ("pagedllm.bench.kv_dtype",
                 "compressed KV (int8, fp8): capacity, decode attention, tok/s, perplexity, agreement"),
    "perplexity": ("pagedllm.bench.perplexity",
                   "perplexity on a held-out text through the paged cache, as the engine flags set it"),
    "prefix": ("pagedllm.bench.prefix",
               "sharing KV blocks: multi-turn TTFT, shared system prompt, n=4 and beam search peaks"),
    "structured": ("pagedllm.bench.structured",
                   "grammar constraints: bitmask fill, apply and accept per decode step at 1/16/64"),
    "long-context": ("pagedllm.bench.long_context",
                     "paging at 1k-1M tokens: per-step upkeep, block-table bytes, attention, by block size"),
    "constrained": ("pagedllm.bench.constrained",
                    "generated tok/s constrained to a JSON schema against free; step cost at 1/16/64"),
    "tensor-parallel": ("pagedllm.bench.tensor_parallel",
                        "throughput and all-reduce time per step at tensor_parallel_size 1, 2, ...; "
                        "communication per step for 7B/70B"),
    "proposers": ("pagedllm.bench.proposers",
                  "speculative decoding's proposers alone: cost per call at 64 x 4k tokens, tokens "
                  "per step on the copy workload's reference answers"),
    "repeated": ("pagedllm.bench.repeated",
                 "speculative decoding on repeated work: each copy request sent twice, the repeat's "
                 "tok/s with n-gram and suffix proposals against plain decoding"),
    "isolation": ("pagedllm.bench.isolation",
                  "one hostile client against another: a stream's token gaps and a tiny request's "
                  "answer under each of issue 32's attacks (a running server)"),
    "moe": ("pagedllm.bench.moe",
            "write a random-weight mixture-of-experts GGUF to race on; bytes a decoded token reads "
            "against the dense equivalent"),
    "lora": ("pagedllm.bench.lora",
             "LoRA: throughput with 1/4/16 rank-16 adapters mixed in the workload against the base "
             "alone; RSS over adapter load/evict cycles"),
    "dashboard": ("pagedllm.bench.dashboard",
                  "the dashboard's snapshot (block map + figures + JSON) against a decode step"),
}
# Benches that talk to a server take no engine flags.
CLIENT_ONLY = {"serve", "isolation"}


class _BenchParser(argparse.ArgumentParser):
    """A bench's parser that imports its module (which adds the bench's own flags) only when that
    bench is chosen. Every pagedllm command builds every parser: importing all the benches for
    each would load what the heaviest needs (bench structured: llguidance's torch helpers and
    torch._dynamo, 200 MiB of RSS) into `pagedllm serve` and every bench's RSS figures."""

    bench_module: str | None = None

    def parse_known_args(self, args=None, namespace=None):
        if self.bench_module is not None:
            module_name, self.bench_module = self.bench_module, None
            importlib.import_module(module_name).add_args(self)
        return super().parse_known_args(args, namespace)


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench", required=True, parser_class=_BenchParser)
    for name, (module_name, help_text) in BENCHES.items():
        parser = kinds.add_parser(name, help=help_text)
        add_workload_args(parser)
        if name not in CLIENT_ONLY:
            add_engine_args(parser)
        parser.bench_module = module_name
    _register_scheduler_bench(kinds)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", default="random", help="'random' or a .jsonl file")
    parser.add_argument("--num-prompts", type=int)
    parser.add_argument("--input-len", help="prompt length range, e.g. 32-512")
    parser.add_argument("--output-len", help="output length range, e.g. 32-256")
    parser.add_argument("--output-json", default=None)


def _register_scheduler_bench(kinds) -> None:
    parser = kinds.add_parser("scheduler", help="scheduler + KV manager overhead per step")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    parser.set_defaults(func=_run_scheduler_bench)


def _run_scheduler_bench(args: argparse.Namespace) -> int:
    from pagedllm.bench import scheduler_overhead  # the scheduler's imports only when it runs

    return scheduler_overhead.main(args.args) or 0
