"""`pagedllm bench moe`: the random MoE GGUF it writes loads in the engine and generates, its
bytes per decoded token count the top-k experts' share of the expert tensors, and the memory a
load takes grows with the file's bytes, not with the experts' dequantized size."""

from __future__ import annotations

from pagedllm import LLM, SamplingParams
from pagedllm.bench.moe import MoEShape, bytes_per_token, load_memory, write_random_moe_gguf
from tests.conftest import requires_default_model


@requires_default_model
def test_the_random_moe_file_loads_and_its_bytes_per_token_add_up(tmp_path):
    shape = MoEShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     num_experts=8, experts_per_token=2, expert_intermediate=32)
    path = tmp_path / "moe.gguf"
    write_random_moe_gguf(path, shape, "Q8_0", seed=1)
    report = bytes_per_token(path)
    # Q8_0: 34 bytes per 32 weights. Experts: 3 projections of 32 x 64 per expert and layer.
    expert_bytes = 2 * 8 * 3 * 32 * 64 * 34 // 32
    assert report["dense_equivalent_bytes_per_token"] - report["bytes_per_decoded_token"] == \
        expert_bytes * 6 // 8
    llm = LLM(model=str(path), num_kv_blocks=16, block_size=16, max_model_len=128)
    assert llm.engine.model_config.num_experts == 8
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


@requires_default_model
def test_rss_after_load_grows_by_the_files_bytes(tmp_path):
    """Two files that differ only in their experts' count (about 65 MiB of Q8_0 experts apart):
    the RSS after load differs by about those bytes (1.07x on ep-2c; the bound 1.3x), where experts
    dequantized to bf16 would take 1.9x them, to float32 3.8x, and the file mapped beside a copy
    2x. The engine's fixed cost (tokenizer, kernels, heap) is the same in both and cancels."""
    measured = {}
    for experts in (4, 40):
        shape = MoEShape(hidden_size=384, num_layers=4, num_heads=6, num_kv_heads=2, head_dim=64,
                         num_experts=experts, experts_per_token=2, expert_intermediate=384)
        path = tmp_path / f"moe{experts}.gguf"
        write_random_moe_gguf(path, shape, "Q8_0", seed=1)
        measured[experts] = load_memory(path, "16MiB")
        held = measured[experts]["weights_held_mib"] / measured[experts]["file_mib"]
        assert 0.9 < held <= 1.0  # the engine's own count: the file's weights, no more
    small, large = measured[4], measured[40]
    assert small["kv_cache_mib"] == large["kv_cache_mib"] == 16
    grown = large["load_growth_mib"] - small["load_growth_mib"]
    per_file_byte = grown / (large["file_mib"] - small["file_mib"])
    assert 0.85 < per_file_byte < 1.3, measured
