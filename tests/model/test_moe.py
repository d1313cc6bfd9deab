"""Mixture-of-experts models (model/moe.py): the fused layer against a per-token reference loop, and
the whole engine against transformers' greedy tokens through the paths that move KV around
(prefix-cache hits, preemption, n > 1). The logits of each shape are checked layer by layer in
test_llama_equivalence.py (qwen3_moe and mixtral_moe are in tiny.SHAPES)."""

from __future__ import annotations

import gguf
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm import LLM, SamplingParams
from pagedllm.model.config import ModelConfig
from pagedllm.model.errors import UnsupportedModelError
from pagedllm.model.llama import MLP
from pagedllm.model.loader import load_model
from pagedllm.model.moe import SparseMoE, route
from pagedllm.model.quant_linear import QuantLinear
from tests.model.test_llama_equivalence import token_ids
from tests.model.test_quantized_model import greedy_generate
from tests.model.tiny import make_hf_model, write_gguf

Q = gguf.GGMLQuantizationType

HIDDEN, INTERMEDIATE = 8, 6


def moe_layer(num_experts: int, top_k: int, normalize: bool, seed: int) -> SparseMoE:
    config = ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=16, hidden_size=HIDDEN, intermediate_size=4,
        num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=HIDDEN,
        rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None, max_position_embeddings=64,
        tie_word_embeddings=True, attention_bias=False, bos_token_id=None,
        num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=INTERMEDIATE,
        norm_topk_prob=normalize)
    layer = SparseMoE(config, [MLP(config, INTERMEDIATE) for _ in range(num_experts)])
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64))
    return layer.double()


def reference(layer: SparseMoE, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor):
    """Each token alone, each of its picks alone: the definition the fused layer must equal."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            expert = layer.experts[int(experts[t, j])]
            gate, up = (expert.gate_up_proj.weight @ x[t]).chunk(2)
            out[t] += weights[t, j] * (expert.down_proj.weight @ (torch.nn.functional.silu(gate) * up))
    return out


@settings(max_examples=60, deadline=None)
@given(num_experts=st.integers(1, 6), data=st.data(), tokens=st.integers(1, 9),
       normalize=st.booleans(), seed=st.integers(0, 2**16))
def test_the_fused_layer_equals_a_loop_over_tokens(num_experts, data, tokens, normalize, seed):
    top_k = data.draw(st.integers(1, num_experts))
    layer = moe_layer(num_experts, top_k, normalize, seed)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    # Random routes: experts with no token, and the same expert picked by several tokens (or by
    # one token twice, which the router never does but the layer must still add up).
    experts = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, num_experts - 1), min_size=top_k,
                                                       max_size=top_k), min_size=tokens, max_size=tokens)))
    generator = torch.Generator().manual_seed(seed + 2)
    weights = torch.rand(tokens, top_k, generator=generator, dtype=torch.float64)
    fused = layer.run_experts(x, weights, experts)
    torch.testing.assert_close(fused, reference(layer, x, weights, experts), rtol=1e-12, atol=1e-12)


def test_routing_takes_the_top_scores_and_renormalizes_where_asked():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    probs = torch.softmax(logits, -1)
    weights, experts = route(logits, 2, normalize=False)
    assert experts.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, probs[:, [1, 2]])
    weights, _ = route(logits, 2, normalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1))


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_router_equals_route(tier, normalize, dtype):
    """csrc/moe_route.cpp against route() on the same logits' inputs: the same experts in the same
    order, the weights within fp32 sums' order (and the dtype's one rounding)."""
    from pagedllm.kernels import tiers

    generator = torch.Generator().manual_seed(7)
    x = torch.randn(9, 40, generator=generator).to(dtype)
    router = torch.randn(12, 40, generator=generator)
    weights, experts = tiers.current().ops.moe_route(x, router, 3, normalize, 0.5)
    expected_weights, expected = route(torch.nn.functional.linear(x.float(), router), 3, normalize, scale=0.5)
    assert torch.equal(experts, expected) and weights.dtype == dtype
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(weights.float(), expected_weights.to(dtype).float(), **tolerance)
    with pytest.raises(RuntimeError, match="top_k must be in"):
        tiers.current().ops.moe_route(x, router, 13, normalize, 1.0)


def test_a_config_with_more_picks_than_experts_is_refused():
    config = moe_layer(2, 1, True, seed=0)  # builds
    assert config.num_experts == 2
    with pytest.raises(ValueError, match="num_experts_per_tok=3 must be between 1 and num_experts=2"):
        moe_layer(2, 3, True, seed=0)


def hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, eos_token_id=[], pad_token_id=0, max_new_tokens=max_tokens,
                            do_sample=False, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("shape", ["qwen3_moe", "mixtral_moe", "deepseek_v2_mla", "deepseek_v3_mla"])
def test_the_engine_gives_transformers_tokens_through_cache_hits_preemption_and_n(shape, tiny_checkpoint):
    checkpoint = tiny_checkpoint(shape)
    shared = token_ids(12, seed=40)
    prompts = [shared + token_ids(length, seed=41 + length) for length in (3, 7, 9, 5)]
    expected = [hf_greedy(checkpoint.hf_model, p, 10) for p in prompts]
    # 10 blocks of 4 tokens cannot hold four requests of ~25 tokens (two of them forked n=2)
    # at once: requests are preempted and recomputed; the shared 12 tokens hit the prefix cache.
    llm = LLM(model=str(checkpoint.folder), dtype="float32", block_size=4, max_model_len=32,
              num_kv_blocks=10, max_num_batched_tokens=16, enable_prefix_caching=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert first.outputs[0].token_ids == expected[0]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    for output, want in zip(outputs, expected[1:], strict=True):
        assert [c.token_ids for c in output.outputs] == [want, want]
    assert sum(o.num_cached_tokens for o in outputs) > 0
    stats = llm.memory_stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("shape", ["qwen3_moe", "mixtral_moe"])
def test_quantized_gguf_experts_stay_quantized_and_equal_dequantized(shape, tmp_path):
    hf_model = make_hf_model(shape, mlp_only_layers=[], norm_topk_prob=True) if shape == "qwen3_moe" \
        else make_hf_model(shape)
    layers = hf_model.config.num_hidden_layers
    # Each layer's stacked experts in another type: cut per expert, each expert's rows kept quantized.
    types = [Q.Q8_0, Q.Q4_0, Q.Q5_1]
    quantize = {f"blk.{i}.ffn_{p}_exps.weight": types[(i + j) % len(types)]
                for i in range(layers) for j, p in enumerate(("gate", "up", "down"))}
    path = write_gguf(hf_model, tmp_path / "moe.gguf", quantize=quantize)
    kept = load_model(path, dtype="float32", quantization="auto")
    dequantized = load_model(path, dtype="float32", quantization="none")
    experts = [e for layer in kept.model.layers for e in layer.mlp.experts]
    assert experts and all(isinstance(e.gate_up_proj, QuantLinear) and isinstance(e.down_proj, QuantLinear)
                           for e in experts)
    prompts = [token_ids(n, seed=60 + n) for n in (1, 5, 17)]
    assert greedy_generate(kept.model, prompts, max_new_tokens=10) == \
        greedy_generate(dequantized.model, prompts, max_new_tokens=10)


def test_an_unsupported_expert_tensor_type_is_refused_by_name(tmp_path):
    path = write_gguf(make_hf_model("mixtral_moe"), tmp_path / "moe.gguf",
                      raw_types={"blk.1.ffn_down_exps.weight": Q.IQ2_XXS})
    with pytest.raises(UnsupportedModelError) as info:
        load_model(path, dtype="float32")
    assert "IQ2_XXS" in str(info.value) and "blk.1.ffn_down_exps.weight" in str(info.value)
