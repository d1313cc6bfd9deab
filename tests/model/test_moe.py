"""Mixture-of-experts models (model/moe.py): the fused layer (and Qwen2-MoE's gated shared expert)
against a per-token reference loop, the config keys against transformers' own reading of them, and
the whole engine against transformers' greedy tokens through the paths that move KV around
(prefix-cache hits, preemption, n > 1), from HF folders and GGUF files alike. The logits of each
shape are checked layer by layer in test_llama_equivalence.py (qwen2_moe, qwen3_moe and
mixtral_moe are in tiny.SHAPES)."""

from __future__ import annotations

from unittest import mock

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm import LLM, SamplingParams
from pagedllm.model.config import ModelConfig
from pagedllm.model.errors import ModelLoadError, UnsupportedModelError
from pagedllm.model.llama import MLP
from pagedllm.model.loader import load_model
from pagedllm.model.moe import Router, SparseMoE, route
from pagedllm.model.quant_linear import QuantLinear
from tests.model.paged import PagedSequences
from tests.model.test_llama_equivalence import assert_logits_close, hf_chunked_logits, token_ids
from tests.model.test_quantized_model import greedy_generate
from tests.model.tiny import _COMMON, GGUF_OVERRIDES, SHAPES, make_hf_model, save_checkpoint, write_gguf

Q = gguf.GGMLQuantizationType

HIDDEN, INTERMEDIATE, SHARED = 8, 6, 5


def moe_layer(num_experts: int, top_k: int, normalize: bool, seed: int, shared: bool = False) -> SparseMoE:
    """Qwen3-MoE's layer; shared: Qwen2-MoE's, with its gated shared expert."""
    config = ModelConfig(
        architecture="Qwen2MoeForCausalLM" if shared else "Qwen3MoeForCausalLM", vocab_size=16,
        hidden_size=HIDDEN, intermediate_size=4,
        num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=HIDDEN,
        rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None, max_position_embeddings=64,
        tie_word_embeddings=True, attention_bias=False, bos_token_id=None,
        num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=INTERMEDIATE,
        norm_topk_prob=normalize, shared_expert_intermediate_size=SHARED if shared else 0)
    layer = SparseMoE(config, [MLP(config, INTERMEDIATE) for _ in range(num_experts)],
                      MLP(config, SHARED) if shared else None)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64))
    return layer.double()


def mlp_of_one_token(mlp: MLP, v: torch.Tensor) -> torch.Tensor:
    gate, up = (mlp.gate_up_proj.weight @ v).chunk(2)
    return mlp.down_proj.weight @ (torch.nn.functional.silu(gate) * up)


def reference(layer: SparseMoE, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor):
    """Each token alone, each of its picks alone: the definition the fused layer must equal."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            out[t] += weights[t, j] * mlp_of_one_token(layer.experts[int(experts[t, j])], x[t])
    return out


def random_routes(data, num_experts: int, top_k: int, tokens: int, seed: int):
    """Random routes: experts with no token, and the same expert picked by several tokens (or by
    one token twice, which the router never does but the layer must still add up)."""
    experts = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, num_experts - 1), min_size=top_k,
                                                       max_size=top_k), min_size=tokens, max_size=tokens)))
    weights = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return weights, experts


@settings(max_examples=60, deadline=None)
@given(num_experts=st.integers(1, 6), data=st.data(), tokens=st.integers(1, 9),
       normalize=st.booleans(), seed=st.integers(0, 2**16))
def test_the_fused_layer_equals_a_loop_over_tokens(num_experts, data, tokens, normalize, seed):
    top_k = data.draw(st.integers(1, num_experts))
    layer = moe_layer(num_experts, top_k, normalize, seed)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    weights, experts = random_routes(data, num_experts, top_k, tokens, seed + 2)
    fused = layer.run_experts(x, weights, experts)
    torch.testing.assert_close(fused, reference(layer, x, weights, experts), rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(num_experts=st.integers(1, 6), data=st.data(), tokens=st.integers(1, 9),
       normalize=st.booleans(), seed=st.integers(0, 2**16))
def test_a_gated_shared_expert_adds_to_the_fused_layer_as_a_loop_does(num_experts, data, tokens, normalize,
                                                                     seed):
    """Qwen2-MoE's layer, forward as the model runs it, on random routes: each token's picks, plus
    its shared expert's output times sigmoid(shared_expert_gate . x), token by token."""
    top_k = data.draw(st.integers(1, num_experts))
    layer = moe_layer(num_experts, top_k, normalize, seed, shared=True)
    assert isinstance(layer.shared_expert_gate, Router)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    weights, experts = random_routes(data, num_experts, top_k, tokens, seed + 2)
    with mock.patch("pagedllm.model.moe.route", return_value=(weights, experts)):
        fused = layer(x)
    expected = reference(layer, x, weights, experts)
    for t in range(tokens):
        gate = torch.sigmoid(layer.shared_expert_gate.weight[0] @ x[t])
        expected[t] += gate * mlp_of_one_token(layer.shared_experts, x[t])
    torch.testing.assert_close(fused, expected, rtol=1e-12, atol=1e-12)


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


def assert_engine_gives_transformers_tokens(source, hf_model) -> None:
    """The engine on source (a folder or a GGUF file) gives hf_model's greedy tokens through
    prefix-cache hits, preemption and n > 1."""
    shared = token_ids(12, seed=40)
    prompts = [shared + token_ids(length, seed=41 + length) for length in (3, 7, 9, 5)]
    expected = [hf_greedy(hf_model, p, 10) for p in prompts]
    # 10 blocks of 4 tokens cannot hold four requests of ~25 tokens (three of them forked n=3)
    # at once: requests are preempted and recomputed; the shared 12 tokens hit the prefix cache.
    llm = LLM(model=str(source), dtype="float32", block_size=4, max_model_len=32,
              num_kv_blocks=10, max_num_batched_tokens=16, enable_prefix_caching=True)
    assert llm.engine.model_config.architecture == type(hf_model).__name__
    first = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert first.outputs[0].token_ids == expected[0]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    for output, want in zip(outputs, expected[1:], strict=True):
        assert [c.token_ids for c in output.outputs] == [want, want, want]
    assert sum(o.num_cached_tokens for o in outputs) > 0
    stats = llm.memory_stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("shape", ["qwen2_moe", "qwen3_moe", "mixtral_moe", "deepseek_v2_mla",
                                   "deepseek_v3_mla", "gpt_oss"])
def test_the_engine_gives_transformers_tokens_through_cache_hits_preemption_and_n(shape, tiny_checkpoint):
    checkpoint = tiny_checkpoint(shape)
    assert_engine_gives_transformers_tokens(checkpoint.folder, checkpoint.hf_model)


@pytest.mark.parametrize("shape", ["qwen2_moe", "qwen3_moe", "mixtral_moe", "gpt_oss"])
def test_gguf_files_give_transformers_tokens_through_cache_hits_preemption_and_n(shape, tmp_path):
    """The same weights as llama.cpp's GGUF (qwen2moe, qwen3moe, Mixtral as llama, gpt-oss; F32):
    the folder's tokens above, transformers' own, through the same paths."""
    hf_model = make_hf_model(shape, seed=3, **GGUF_OVERRIDES.get(shape, {}))
    assert_engine_gives_transformers_tokens(write_gguf(hf_model, tmp_path / "moe.gguf"), hf_model)


@pytest.mark.parametrize("shape", ["qwen3_moe", "mixtral_moe", "qwen2_moe"])
def test_quantized_gguf_experts_stay_quantized_and_equal_dequantized(shape, tmp_path):
    hf_model = make_hf_model(shape, **GGUF_OVERRIDES.get(shape, {}))
    layers = hf_model.config.num_hidden_layers
    # Each layer's stacked experts in another type: cut per expert, each expert's rows kept quantized;
    # Qwen2-MoE's shared expert quantized too, and its router and shared gate (which llama.cpp's
    # files keep F32) in Q8_0: those the loader dequantizes, the routers multiplying in float32.
    types = [Q.Q8_0, Q.Q4_0, Q.Q5_1]
    parts = ["exps"] + (["shexp"] if shape == "qwen2_moe" else [])
    quantize = {f"blk.{i}.ffn_{p}_{kind}.weight": types[(i + j) % len(types)]
                for i in range(layers) for j, p in enumerate(("gate", "up", "down")) for kind in parts}
    if shape == "qwen2_moe":
        quantize.update({f"blk.{i}.ffn_gate_inp{suffix}.weight": Q.Q8_0
                         for i in range(layers) for suffix in ("", "_shexp")})
    path = write_gguf(hf_model, tmp_path / "moe.gguf", quantize=quantize)
    kept = load_model(path, dtype="float32", quantization="auto")
    dequantized = load_model(path, dtype="float32", quantization="none")
    experts = [e for layer in kept.model.layers for e in layer.mlp.experts]
    if shape == "qwen2_moe":
        mixtures = [layer.mlp for layer in kept.model.layers]
        experts += [m.shared_experts for m in mixtures]
        assert all(type(m.gate) is Router and type(m.shared_expert_gate) is Router for m in mixtures)
    assert experts and all(isinstance(e.gate_up_proj, QuantLinear) and isinstance(e.down_proj, QuantLinear)
                           for e in experts)
    prompts = [token_ids(n, seed=60 + n) for n in (1, 5, 17)]
    assert greedy_generate(kept.model, prompts, max_new_tokens=10) == \
        greedy_generate(dequantized.model, prompts, max_new_tokens=10)


@pytest.mark.parametrize("shape, tensor", [("mixtral_moe", "blk.1.ffn_down_exps.weight"),
                                           ("qwen3_moe", "blk.2.ffn_gate_exps.weight"),
                                           ("qwen2_moe", "blk.0.ffn_up_exps.weight"),
                                           ("qwen2_moe", "blk.2.ffn_down_shexp.weight"),
                                           ("gpt_oss", "blk.2.ffn_up_exps.weight")])
def test_an_unsupported_expert_tensor_type_is_refused_by_name(shape, tensor, tmp_path):
    overrides = {"mlp_only_layers": []} if shape.startswith("qwen") else {}
    path = write_gguf(make_hf_model(shape, **overrides), tmp_path / "moe.gguf", raw_types={tensor: Q.IQ2_XXS})
    with pytest.raises(UnsupportedModelError) as info:
        load_model(path, dtype="float32")
    message = str(info.value)
    assert "IQ2_XXS" in message and tensor in message and "\n" not in message


def test_a_qwen2_moe_shared_gate_stored_as_a_vector_loads_as_its_row(tmp_path):
    """llama.cpp reads ffn_gate_inp_shexp as {n_embd}: a file that stores it one-dimensional
    gives the same model as one that stores transformers' [1, hidden]."""
    from tests.model import tiny

    hf_model = make_hf_model("qwen2_moe", seed=5, mlp_only_layers=[])
    as_written = tiny._gguf_tensors

    def with_vector_gates(model, arch):
        return {name: tensor.reshape(-1) if name.endswith("ffn_gate_inp_shexp.weight") else tensor
                for name, tensor in as_written(model, arch).items()}

    with mock.patch.object(tiny, "_gguf_tensors", with_vector_gates):
        vector = load_model(write_gguf(hf_model, tmp_path / "vector.gguf"), dtype="float32").model
    row = load_model(write_gguf(hf_model, tmp_path / "row.gguf"), dtype="float32").model
    assert vector.layers[0].mlp.shared_expert_gate.weight.shape == (1, hf_model.config.hidden_size)
    prompts = [token_ids(n, seed=90 + n) for n in (3, 11)]
    assert greedy_generate(vector, prompts, 6) == greedy_generate(row, prompts, 6)


def _qwen2_moe_config(**overrides):
    import transformers

    args = {**_COMMON, **SHAPES["qwen2_moe"][1], **overrides}
    return transformers.Qwen2MoeConfig(**args, architectures=["Qwen2MoeForCausalLM"])


@pytest.mark.parametrize("layers, step, dense", [(6, 1, []), (6, 2, []), (6, 3, [5]), (5, 1, [0, 3])])
def test_qwen2_moe_sparse_layers_are_those_transformers_builds(layers, step, dense):
    import transformers

    config = _qwen2_moe_config(num_hidden_layers=layers, decoder_sparse_step=step, mlp_only_layers=dense)
    with torch.device("meta"):
        hf_layers = transformers.Qwen2MoeForCausalLM(config).model.layers
    sparse = tuple(i for i, layer in enumerate(hf_layers) if hasattr(layer.mlp, "shared_expert_gate"))
    assert ModelConfig.from_hf_config(config.to_dict()).moe_layers == sparse


def test_qwen2_moe_sliding_layers_are_those_transformers_reads():
    """Every other layer below max_window_layers, from layer_types as transformers writes them and
    from the older keys alone."""
    config = _qwen2_moe_config(num_hidden_layers=6, use_sliding_window=True, sliding_window=5,
                               max_window_layers=4).to_dict()
    expected = tuple(i for i, kind in enumerate(config["layer_types"]) if kind == "sliding_attention")
    assert expected == (0, 2)
    for source in (config, {k: v for k, v in config.items() if k != "layer_types"}):
        ours = ModelConfig.from_hf_config(source)
        assert (ours.sliding_window, ours.sliding_layers) == (5, expected)


def test_qwen2_moe_keys_a_config_leaves_out_take_transformers_defaults():
    import transformers

    keys = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
            "norm_topk_prob")
    minimal = dict(_COMMON, architectures=["Qwen2MoeForCausalLM"])
    hf_config = transformers.Qwen2MoeConfig(**minimal)
    ours = ModelConfig.from_hf_config(minimal)
    assert [getattr(ours, k) for k in keys] == [getattr(hf_config, k) for k in keys]
    assert ours.attention_bias and not ours.output_bias and ours.moe_layers == (0, 1)


def test_qwen2_moe_without_qkv_bias_equals_transformers(tmp_path):
    hf_model = make_hf_model("qwen2_moe", qkv_bias=False)
    loaded = load_model(save_checkpoint(hf_model, tmp_path), dtype="float32")
    assert not loaded.config.attention_bias and loaded.model.layers[0].self_attn.qkv_proj.bias is None
    ids = token_ids(14, seed=80)
    ours = PagedSequences(loaded.model, num_blocks=6, block_size=4).step({0: ids})[0]
    assert_logits_close(ours, hf_chunked_logits(hf_model, ids, [len(ids)]))


def test_a_decoder_sparse_step_below_one_is_refused():
    config = _qwen2_moe_config().to_dict() | {"decoder_sparse_step": 0}
    with pytest.raises(ModelLoadError, match="decoder_sparse_step must be a positive integer; got 0"):
        ModelConfig.from_hf_config(config)




def mxfp4_round_trip(hf_model) -> None:
    """Each expert weight of a gpt-oss model replaced, in place, by its MXFP4 value as the GGUF
    will hold it (blocks of 32 along each row's inputs): both paths then hold the same weights."""
    with torch.no_grad():
        for layer in hf_model.model.layers:
            for param in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                rows = param.transpose(1, 2)  # [E, out, in], as llama.cpp stores them
                flat = rows.reshape(-1, rows.shape[-1]).numpy()
                blocks = gguf.quants.quantize(flat, Q.MXFP4)
                exact = torch.from_numpy(gguf.quants.dequantize(blocks, Q.MXFP4)).view(rows.shape)
                assert not torch.equal(exact, rows)  # the round trip moved the weights
                param.copy_(exact.transpose(1, 2))


def test_gpt_oss_mxfp4_experts_stay_quantized_and_give_transformers_logits(tmp_path):
    """gguf's MXFP4 experts kept MXFP4 (4-bit codes, E2M1 codebook, power-of-two scales) give
    transformers' float32 logits and greedy tokens on the same (round-tripped) weights, as the
    float GGUF and the Hugging Face folder do (test_llama_equivalence.py)."""
    from tests.model.paged import PagedSequences
    from tests.model.test_llama_equivalence import assert_logits_close, hf_chunked_logits

    hf_model = make_hf_model("gpt_oss", swiglu_limit=7.0)  # llama.cpp's files hold no clamp key
    mxfp4_round_trip(hf_model)
    layers = hf_model.config.num_hidden_layers
    quantize = {f"blk.{i}.ffn_{p}_exps.weight": Q.MXFP4
                for i in range(layers) for p in ("gate", "up", "down")}
    path = write_gguf(hf_model, tmp_path / "gpt_oss_mxfp4.gguf", quantize=quantize)
    loaded = load_model(path, dtype="float32")
    experts = [e for layer in loaded.model.layers for e in layer.mlp.experts]
    assert all(isinstance(p, QuantLinear) and p.parts[0].source == "MXFP4"
               for e in experts for p in (e.gate_up_proj, e.down_proj))
    assert "MXFP4 quantized" in loaded.weights_note
    ids = token_ids(22, seed=70)
    paged = PagedSequences(loaded.model, num_blocks=12, block_size=4)
    ours = torch.cat([paged.step({0: ids[:12]})[0], paged.step({0: ids[12:]})[0]])
    assert_logits_close(ours, hf_chunked_logits(hf_model, ids, [12, 10]))
    prompts = [token_ids(n, seed=71 + n) for n in (3, 14)]
    llm = LLM(model=str(path), dtype="float32", block_size=4, max_model_len=32, kv_cache_memory="1MiB",
              max_num_batched_tokens=8)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf_model, p, 10) for p in prompts]


def test_gpt_oss_experts_in_nvfp4_are_refused_by_name(tmp_path):
    """NVFP4, the other FP4 format, is not MXFP4: refused like any type without a reader."""
    path = write_gguf(make_hf_model("gpt_oss"), tmp_path / "gpt_oss.gguf",
                      raw_types={"blk.2.ffn_up_exps.weight": Q.NVFP4})
    with pytest.raises(UnsupportedModelError) as info:
        load_model(path, dtype="float32")
    assert "NVFP4" in str(info.value) and "blk.2.ffn_up_exps.weight" in str(info.value)


def save_mxfp4_folder(hf_model, folder):
    """The model as the released gpt-oss checkpoints are saved: each stacked expert weight as
    MXFP4 {name}_blocks [E, out, in / 32, 16] and {name}_scales [E, out, in / 32], checked against
    transformers' own reading of them (its weights must already be MXFP4 values: mxfp4_round_trip)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tests.model.tiny import save_checkpoint

    save_checkpoint(hf_model, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    for i in range(hf_model.config.num_hidden_layers):
        for stacked in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{stacked}"
            weights = tensors.pop(name)
            rows = weights.transpose(1, 2).contiguous()  # [E, out, in]
            experts, out, inputs = rows.shape
            packed = gguf.quants.quantize(rows.reshape(-1, inputs).numpy(), Q.MXFP4)
            packed = packed.reshape(experts, out, inputs // 32, 17)
            codes = np.concatenate([packed[..., 1:] & 0x0F, packed[..., 1:] >> 4], axis=-1)  # in order
            blocks = torch.from_numpy(codes[..., 0::2] | (codes[..., 1::2] << 4))
            scales = torch.from_numpy(np.ascontiguousarray(packed[..., 0]))
            assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), weights)
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_mxfp4_experts_of_a_hugging_face_folder_stay_mxfp4_and_give_transformers_logits(tmp_path):
    """The released checkpoints' layout: experts kept MXFP4 (or dequantized with quantization
    none) give transformers' float32 logits on the same weights, and its greedy tokens."""
    from tests.model.paged import PagedSequences
    from tests.model.test_llama_equivalence import assert_logits_close, hf_chunked_logits

    hf_model = make_hf_model("gpt_oss")
    mxfp4_round_trip(hf_model)
    folder = save_mxfp4_folder(hf_model, tmp_path / "mxfp4")
    ids = token_ids(22, seed=80)
    expected = hf_chunked_logits(hf_model, ids, [12, 10])
    for quantization, kind in (("auto", QuantLinear), ("none", torch.nn.Linear)):
        loaded = load_model(folder, dtype="float32", quantization=quantization)
        experts = [e for layer in loaded.model.layers for e in layer.mlp.experts]
        assert all(type(p) is kind for e in experts for p in (e.gate_up_proj, e.down_proj))
        paged = PagedSequences(loaded.model, num_blocks=12, block_size=4)
        ours = torch.cat([paged.step({0: ids[:12]})[0], paged.step({0: ids[12:]})[0]])
        assert_logits_close(ours, expected)
    assert "MXFP4" in load_model(folder, dtype="float32").weights_note
    prompt = token_ids(9, seed=81)
    llm = LLM(model=str(folder), dtype="float32", block_size=4, max_model_len=32, kv_cache_memory="1MiB")
    output = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=10,
                                                                         ignore_eos=True), use_tqdm=False)
    assert output[0].outputs[0].token_ids == hf_greedy(hf_model, prompt, 10)
