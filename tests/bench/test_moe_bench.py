"""`pagedllm bench moe`: the random MoE GGUF it writes loads in the engine and generates, and its
bytes per decoded token count the top-k experts' share of the expert tensors."""

from __future__ import annotations

from pagedllm import LLM, SamplingParams
from pagedllm.bench.moe import MoEShape, bytes_per_token, write_random_moe_gguf
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
