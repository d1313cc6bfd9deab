"""A decode burst in one compiled call (DecodeLayers.burst, csrc/decode_burst.cpp) gives bit for bit
the tokens of run_burst's Python loop and of one decode step per engine step, on every tier that
compiles it: quantized and plain embedding tables, tied and untied quantized heads, a mixture of
experts, float32 and bf16, 1 to 4 streams whose bursts end at different steps. Bursts the call does
not take (a float head, a rope past its length limit) keep the loop."""

from __future__ import annotations

import gguf
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.bench.moe import MoEShape, write_random_moe_gguf
from tests.engine.test_llm_engine import assert_all_blocks_free
from tests.model.test_decode_layers import tier_runs_it
from tests.model.tiny import make_hf_model, write_gguf

Q = gguf.GGMLQuantizationType
PROMPTS = [[5, 9, 20, 33, 41, 7, 7, 100, 3, 18, 2], [77, 1, 250], [12] * 19, [40, 41, 42, 43]]
MAX_TOKENS = [17, 9, 12, 3]  # bursts of 5: each stream's last ends at another step


def _dense_gguf(tmp_path, shape: str, embedding, head) -> str:
    """A tiny model's GGUF with Q8_0 layers, its embedding table (and untied head) as given."""
    hf_model = make_hf_model(shape)
    names = {f"blk.{i}.{part}.weight": Q.Q8_0 for i in range(hf_model.config.num_hidden_layers)
             for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    for name, kind in (("token_embd.weight", embedding), ("output.weight", head)):
        if kind is not None:
            names[name] = kind
    return str(write_gguf(hf_model, tmp_path / f"{shape}.gguf", quantize=names))


def _moe_gguf(tmp_path) -> str:
    path = tmp_path / "moe.gguf"
    write_random_moe_gguf(path, MoEShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                         head_dim=16, num_experts=4, experts_per_token=2,
                                         expert_intermediate=32), "Q8_0", seed=1)
    return str(path)


MODELS = {  # name: (writer, whether its bursts take the call)
    "untied, plain table": (lambda t: _dense_gguf(t, "llama_gqa_untied", None, Q.Q8_0), True),
    "tied, quantized table": (lambda t: _dense_gguf(t, "qwen3_qk_norm", Q.Q8_0, None), True),
    "mixture of experts": (_moe_gguf, True),
    "float head": (lambda t: _dense_gguf(t, "llama_gqa_untied", Q.Q8_0, None), False),
}


def _llm(path: str, dtype: str, burst: int) -> LLM:
    return LLM(path, dtype=dtype, block_size=4, num_kv_blocks=128, max_model_len=128,
               enable_prefix_caching=False, decode_burst=burst)


def _tokens(llm: LLM) -> list[list[list[int]]]:
    """Each stream's greedy tokens, for 1, 2 and 4 streams at once."""
    out = []
    for count in (1, 2, 4):
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS[:count]]
        results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:count]], params, use_tqdm=False)
        out.append([r.outputs[0].token_ids for r in results])
    return out


# The mixture's file loads in 8 s: it is tested in bf16 only.
@pytest.mark.parametrize("model,dtype", [(m, d) for m in MODELS for d in ("float32", "bfloat16")
                                         if (m, d) != ("mixture of experts", "float32")])
def test_a_burst_in_one_call_gives_the_loops_tokens(tier, model, dtype, tmp_path):
    write, takes_call = MODELS[model]
    path = write(tmp_path)
    llm = _llm(path, dtype, 5)
    fused = llm.engine.engine_core.executor.runner.model.decode_layers
    if not tier_runs_it():
        assert fused is None
        return
    assert (fused.burst_parts is not None) == takes_call
    calls = []
    burst = fused.burst
    fused.burst = lambda *args: calls.append(1) or burst(*args)
    one_call = _tokens(llm)
    assert bool(calls) == takes_call
    assert_all_blocks_free(llm)
    fused.burst_parts = None  # run_burst's loop
    assert _tokens(llm) == one_call
    assert _tokens(_llm(path, dtype, 1)) == one_call  # a decode step per engine step


def test_a_rope_past_its_length_limit_keeps_the_loop(tier, tmp_path):
    """A burst whose last step passes the length where its rope type changes the frequencies
    (LongRoPE, dynamic NTK) does not take the call, whose frequencies are those of the first."""
    llm = _llm(_dense_gguf(tmp_path, "qwen3_qk_norm", Q.Q8_0, None), "float32", 5)
    runner = llm.engine.engine_core.executor.runner
    fused = runner.model.decode_layers
    if not tier_runs_it():
        return
    from pagedllm.kernels.attention import AttentionMetadata

    def metadata(seq_lens: list[int]) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=None, block_tables=None, seq_lens=None, query_start_loc=None,
                                 seq_lens_cpu=seq_lens, query_start_loc_cpu=[0, seq_lens[0]])

    rotary = fused.burst_parts.rotary
    assert fused.bursts(runner.model, runner.kv_caches, metadata([30]))
    rotary.length_limit = 29
    try:
        assert not fused.bursts(runner.model, runner.kv_caches, metadata([30]))
        assert fused.bursts(runner.model, runner.kv_caches, metadata([29]))
        assert not fused.bursts(runner.model, [*runner.kv_caches], metadata([29]))  # other caches
    finally:
        rotary.length_limit = None
