"""`pagedllm bench moe`: a random-weight mixture-of-experts GGUF to race on, and what a decoded token
reads from it against a dense model of the same total size.

No MoE checkpoint may be downloaded here, so the bench writes one: llama.cpp's qwen3moe layout
(stacked [E, I, H] expert tensors, a router per layer), the default model's tokenizer (so prompts
tokenize as they do for it), random weights quantized by gguf's own quantizer. Race it with
`pagedllm bench throughput --model FILE --baseline llama.cpp` (same file, threads and prompts).

Bytes per decoded token: every weight a token's forward pass reads (attention, norms, the router,
its top-k experts, the LM head) against the dense equivalent that reads every expert.

Memory after load (load_memory): a fresh process imports pagedllm, then builds the engine on the
file with a KV budget (the engine's --kv-cache-memory, else 64 MiB); its RSS growth between the two
against the file's bytes plus the budget. The experts stay quantized, so the weights held are the
file's bytes (Q8_0's 34 bytes per 32 weights); what grows beyond them and the KV cache is a fixed
cost of starting an engine (the tokenizer, the compiled kernels' libraries, Python's heap: about
50 MiB on ep-2c, whatever the file's size), which only a small file's ratio shows. The KV cache's
pages count once the OS maps them (a fresh cache's are not all resident yet), so the growth is at
most the file, the whole budget and that fixed cost.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

QUANT_TYPES = ("Q8_0", "Q4_0")
DEFAULT_KV_CACHE_MEMORY = "64MiB"


@dataclass(frozen=True)
class MoEShape:
    hidden_size: int = 768
    num_layers: int = 8
    num_heads: int = 12
    num_kv_heads: int = 4
    head_dim: int = 64
    num_experts: int = 16
    experts_per_token: int = 2
    expert_intermediate: int = 512


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--write", metavar="FILE", required=True,
                        help="the GGUF to write (left as it is if it exists)")
    parser.add_argument("--quant", choices=QUANT_TYPES, default="Q8_0",
                        help="the matmul weights' type (norms stay F32)")
    for field, default in asdict(MoEShape()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=default)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    shape = MoEShape(**{f: getattr(args, f) for f in asdict(MoEShape())})
    path = Path(args.write)
    if not path.exists():
        write_random_moe_gguf(path, shape, args.quant, args.seed or 0)  # the engine's --seed
    report = bytes_per_token(path)
    report["load_memory"] = load_memory(path, args.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY)
    print(json.dumps(report, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return 0


def write_random_moe_gguf(path: Path, shape: MoEShape, quant: str, seed: int) -> None:
    import gguf

    from pagedllm.model.default_model import default_model_path

    qtype = gguf.GGMLQuantizationType[quant]
    source = gguf.GGUFReader(default_model_path())
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_name("pagedllm random MoE")
    _add_hparams(writer, shape, vocab)
    _copy_tokenizer(source, writer)
    s = shape
    q_rows, kv_rows = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim

    def matmul(name: str, *dims: int) -> None:
        weights = (rng.standard_normal(dims, dtype=np.float32) * dims[-1] ** -0.5).astype(np.float32)
        flat = weights.reshape(-1, dims[-1])
        writer.add_tensor(name, gguf.quants.quantize(flat, qtype).reshape(*dims[:-1], -1), raw_dtype=qtype)

    def norm(name: str, size: int) -> None:
        writer.add_tensor(name, np.ones(size, dtype=np.float32))

    matmul("token_embd.weight", vocab, s.hidden_size)
    norm("output_norm.weight", s.hidden_size)
    for i in range(s.num_layers):
        norm(f"blk.{i}.attn_norm.weight", s.hidden_size)
        norm(f"blk.{i}.ffn_norm.weight", s.hidden_size)
        norm(f"blk.{i}.attn_q_norm.weight", s.head_dim)
        norm(f"blk.{i}.attn_k_norm.weight", s.head_dim)
        matmul(f"blk.{i}.attn_q.weight", q_rows, s.hidden_size)
        matmul(f"blk.{i}.attn_k.weight", kv_rows, s.hidden_size)
        matmul(f"blk.{i}.attn_v.weight", kv_rows, s.hidden_size)
        matmul(f"blk.{i}.attn_output.weight", s.hidden_size, q_rows)
        writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight",  # the router stays F32, as llama.cpp's do
                          rng.standard_normal((s.num_experts, s.hidden_size), dtype=np.float32))
        matmul(f"blk.{i}.ffn_gate_exps.weight", s.num_experts, s.expert_intermediate, s.hidden_size)
        matmul(f"blk.{i}.ffn_up_exps.weight", s.num_experts, s.expert_intermediate, s.hidden_size)
        matmul(f"blk.{i}.ffn_down_exps.weight", s.num_experts, s.hidden_size, s.expert_intermediate)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_hparams(writer, s: MoEShape, vocab: int) -> None:
    writer.add_block_count(s.num_layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(s.hidden_size)
    writer.add_feed_forward_length(s.expert_intermediate)
    writer.add_expert_feed_forward_length(s.expert_intermediate)
    writer.add_head_count(s.num_heads)
    writer.add_head_count_kv(s.num_kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(s.num_experts)
    writer.add_expert_used_count(s.experts_per_token)
    writer.add_vocab_size(vocab)


def _copy_tokenizer(source, writer) -> None:
    import gguf

    for name, field in source.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), kind)


def bytes_per_token(path: Path) -> dict:
    """Weight bytes one decoded token reads, and those of the dense equivalent (every expert)."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    experts = reader.fields[f"{arch}.expert_count"].contents()
    used = reader.fields[f"{arch}.expert_used_count"].contents()
    expert_bytes = other = 0
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":  # one row read per token; tied: the LM head reads all
            other += int(tensor.n_bytes) if "output.weight" not in {t.name for t in reader.tensors} else 0
        elif "_exps." in tensor.name:
            expert_bytes += int(tensor.n_bytes)
        else:
            other += int(tensor.n_bytes)
    active = other + expert_bytes * used // experts
    dense = other + expert_bytes
    return {"file": str(path), "experts": experts, "experts_per_token": used,
            "bytes_per_decoded_token": active, "dense_equivalent_bytes_per_token": dense,
            "ratio": round(active / dense, 4)}


def load_memory(path: Path, kv_cache_memory: str) -> dict:
    """RSS of a fresh process with pagedllm imported, and after it built an engine on the file
    with this KV budget (MiB); the growth against the file plus the KV cache."""
    child = subprocess.run([sys.executable, "-c", "from pagedllm.bench.moe import _report_load_rss; "
                            "_report_load_rss()", str(path), kv_cache_memory],
                           capture_output=True, text=True, check=False)
    if child.returncode != 0:
        raise RuntimeError(f"loading {path} to measure its RSS failed: {child.stderr.strip()[-2000:]}")
    measured = json.loads(child.stdout.strip().splitlines()[-1])
    mib = 2**20
    file_mib = path.stat().st_size / mib
    kv_mib = measured["kv_cache_bytes"] / mib
    growth = measured["rss_loaded_mib"] - measured["rss_imported_mib"]
    return {"file_mib": round(file_mib, 1), "kv_cache_mib": round(kv_mib, 1),
            "weights_held_mib": round(measured["weight_bytes"] / mib, 1),
            "rss_imported_mib": round(measured["rss_imported_mib"], 1),
            "rss_after_load_mib": round(measured["rss_loaded_mib"], 1), "load_growth_mib": round(growth, 1),
            "growth_over_file_plus_kv": round(growth / (file_mib + kv_mib), 3)}


def _report_load_rss() -> None:
    """The child of load_memory: argv is the file and the KV budget; prints one JSON line."""
    import gc

    from pagedllm import LLM

    path, kv_cache_memory = sys.argv[1:3]
    imported = _rss_mib()
    llm = LLM(model=path, kv_cache_memory=kv_cache_memory, max_model_len=256)
    gc.collect()
    stats = llm.memory_stats()
    print(json.dumps({"rss_imported_mib": imported, "rss_loaded_mib": _rss_mib(),
                      "kv_cache_bytes": stats["kv_cache_bytes"], "weight_bytes": stats["weight_bytes"]}))


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return kib / 1024
