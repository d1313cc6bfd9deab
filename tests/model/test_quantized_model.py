"""Models whose weights stay quantized: in float32 their greedy tokens equal the dequantized
model's (GGUF files of every supported quantized type, HF folders quantized to int8 / int4 at
load); what is refused is refused by name; the weights take the bytes they should."""

from __future__ import annotations

import itertools
import logging

import gguf
import pytest
import torch

from pagedllm.model.errors import UnsupportedModelError
from pagedllm.model.gguf_file import SUPPORTED_TYPES
from pagedllm.model.gguf_repack import REPACKERS
from pagedllm.model.loader import load_model
from pagedllm.model.quant_linear import QuantEmbedding, QuantLinear
from tests.conftest import requires_default_model
from tests.kernel_tiers import kernel_tier
from tests.model.paged import greedy_generate
from tests.model.tiny import make_hf_model, write_gguf

Q = gguf.GGMLQuantizationType
# The types the loader takes (issue 22 adds more) that stay quantized.
TYPES = sorted(REPACKERS.keys() & SUPPORTED_TYPES, key=lambda t: t.name)
PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 84, 104, 101, 32, 99, 97, 116, 32], [256, 49, 43, 49, 61],
           [256] + list(range(100, 140))]


def quantized_gguf(tmp_path, types: list, **sizes):
    """A tiny Llama written with its matmul weights in the given types, taken in turn, each where
    its block size divides the rows (K-quants need 256 inputs); q, k, v differ, to exercise fused
    weights made of several layouts."""
    hf_model = make_hf_model("llama_gqa_untied", **sizes)
    names = _matmul_names(hf_model.config)
    cycle = itertools.cycle(types)
    quant_types = {}
    for name, in_features in names:
        for _ in range(len(types)):
            qtype = next(cycle)
            if in_features % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
                quant_types[name] = qtype
                break
    return write_gguf(hf_model, tmp_path / "quantized.gguf", quantize=quant_types), quant_types


def _matmul_names(config) -> list[tuple[str, int]]:
    """GGUF names of the matmul weights and their input sizes."""
    hidden, inner = config.hidden_size, config.intermediate_size
    names = [("token_embd.weight", hidden), ("output.weight", hidden)]
    for i in range(config.num_hidden_layers):
        names += [(f"blk.{i}.attn_{p}.weight", hidden) for p in ("q", "k", "v", "output")]
        names += [(f"blk.{i}.ffn_gate.weight", hidden), (f"blk.{i}.ffn_up.weight", hidden),
                  (f"blk.{i}.ffn_down.weight", inner)]
    return names


def quantized_modules(model) -> list:
    return [m for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]


@pytest.mark.parametrize("sizes", [{}, dict(hidden_size=256, intermediate_size=512)],
                         ids=["32-blocks", "256-blocks"])
def test_gguf_greedy_equals_dequantized(tmp_path, sizes):
    path, quant_types = quantized_gguf(tmp_path, TYPES, **sizes)
    assert quant_types, "no type fits these sizes"
    kept = load_model(path, dtype="float32", quantization="auto")
    dequantized = load_model(path, dtype="float32", quantization="none")
    assert quantized_modules(kept.model) and not quantized_modules(dequantized.model)
    for qtype in set(quant_types.values()):
        assert qtype.name in kept.weights_note
    # 4 prompts: a prefill of many rows (dequantized tiles and a GEMM), decodes of 4 (the kernel)
    ours = greedy_generate(kept.model, PROMPTS, max_new_tokens=12)
    assert ours == greedy_generate(dequantized.model, PROMPTS, max_new_tokens=12)
    # and the logits agree to fp32 summation noise
    hidden = [m(torch.tensor(PROMPTS[3]), torch.arange(len(PROMPTS[3])), *_cache(m, len(PROMPTS[3])))
              for m in (kept.model, dequantized.model)]
    torch.testing.assert_close(kept.model.compute_logits(hidden[0]),
                               dequantized.model.compute_logits(hidden[1]), atol=1e-4, rtol=1e-4)


def _cache(model, num_tokens, dtype=torch.float32):
    from pagedllm.kernels.attention import allocate_kv_cache
    from tests.conftest import build_attn_metadata

    config = model.config
    caches = allocate_kv_cache(config.num_hidden_layers, num_tokens, 1, config.num_key_value_heads,
                               config.head_dim, dtype)
    metadata, _ = build_attn_metadata([(0, num_tokens, list(range(num_tokens)))], 1)
    return caches, metadata


@pytest.mark.parametrize("quantization,group_size", [("int8", 32), ("int4", 32), ("int4", 16)])
def test_hf_folder_quantized_at_load(tiny_checkpoint, tier, quantization, group_size):
    """int8 / int4 on a float checkpoint: every matmul weight quantized, each compiled tier's
    greedy tokens equal the portable tier's (tiles dequantized, then F.linear) on the same weights."""
    folder = tiny_checkpoint("llama_mha_tied_bias").folder  # biases, tied head, head_dim 24
    loaded = load_model(folder, dtype="float32", quantization=quantization, group_size=group_size)
    full = load_model(folder, dtype="float32")
    assert loaded.model.weight_bytes() < full.model.weight_bytes() * (0.5 if quantization == "int4" else 0.6)
    layers = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert {p.source for m in layers for p in m.parts} == {quantization, "int8"}  # head: int8
    assert f"-> {quantization} g{group_size}" in loaded.weights_note
    with_kernels = greedy_generate(loaded.model, PROMPTS, max_new_tokens=10)
    with kernel_tier("portable"):
        portable = load_model(folder, dtype="float32", quantization=quantization, group_size=group_size)
        assert with_kernels == greedy_generate(portable.model, PROMPTS, max_new_tokens=10)


def test_weights_that_do_not_fit_the_group_stay_float(tiny_checkpoint):
    """hidden 64, intermediate 96: a group of 64 fits every input size but down_proj's."""
    loaded = load_model(tiny_checkpoint("llama_gqa_untied").folder, dtype="float32",
                        quantization="int8", group_size=64)
    assert "96 inputs are not a multiple of the group size 64" in loaded.weights_note
    assert isinstance(loaded.model.layers[0].mlp.down_proj, torch.nn.Linear)
    assert isinstance(loaded.model.layers[0].mlp.gate_up_proj, QuantLinear)


def test_gguf_with_int4_is_refused(tmp_path, tiny_checkpoint):
    path = write_gguf(tiny_checkpoint("llama_gqa_untied").hf_model, tmp_path / "tiny.gguf")
    with pytest.raises(ValueError, match="GGUF file keeps its own quantization") as info:
        load_model(path, dtype="float32", quantization="int4")
    assert str(path) in str(info.value)
    with pytest.raises(ValueError, match="auto, none, int8, int4"):
        load_model(path, dtype="float32", quantization="fp8")


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_unsupported_type_refused_by_name(tmp_path, tiny_checkpoint, quantization):
    path = write_gguf(tiny_checkpoint("llama_gqa_untied").hf_model, tmp_path / "iq2.gguf",
                      raw_types={"blk.0.attn_v.weight": Q.IQ2_XXS})
    with pytest.raises(UnsupportedModelError) as info:
        load_model(path, dtype="float32", quantization=quantization)
    assert "IQ2_XXS" in str(info.value) and "blk.0.attn_v.weight" in str(info.value)


def test_engine_reports_weight_bytes(tmp_path, caplog):
    from pagedllm.engine.llm_engine import LLMEngine

    path, _ = quantized_gguf(tmp_path, [Q.Q4_0, Q.Q8_0])
    with caplog.at_level(logging.INFO, logger="pagedllm.engine.llm_engine"):
        engine = LLMEngine(model=str(path), dtype="float32", num_kv_blocks=64, max_model_len=64)
    stats = engine.memory_stats()
    assert stats["weight_bytes"] == engine.engine_core.executor.runner.model.weight_bytes() > 0
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache"))
    assert f"weights {stats['weight_bytes'] / 2**20:.1f} MiB" in line and "Q4_0 quantized" in line


@requires_default_model
def test_default_model_weights_within_a_quarter_of_the_file(default_model, default_model_path):
    """The resident weights of the default GGUF (the session's float32 model, quantization auto)
    take at most 1.25x the file's tensor bytes."""
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(default_model_path).tensors)
    assert quantized_modules(default_model.model)
    assert default_model.model.weight_bytes() <= 1.25 * file_bytes


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_prepacking_keeps_a_quantized_head_and_packs_a_float_one_once(tiny_checkpoint, quantization):
    model = load_model(tiny_checkpoint("llama_gqa_untied").folder, dtype="bfloat16",
                       quantization=quantization).model  # an untied LM head
    hidden = torch.randn(3, model.config.hidden_size).to(torch.bfloat16)
    before = model.compute_logits(hidden)
    if not model.prepack_for_cpu(16):
        pytest.skip("this torch build does not pack bf16 linears here")
    if quantization == "none":
        assert model._packed_lm_head is model.lm_head  # one packed copy, not two
        torch.testing.assert_close(model.compute_logits(hidden), before, atol=0.05, rtol=0.02)
    else:
        assert isinstance(model._packed_lm_head, QuantLinear) and model._packed_lm_head is model.lm_head
        assert torch.equal(model.compute_logits(hidden), before)


def test_greedy_tokens_of_a_quantized_head_are_the_logits_argmax(tiny_checkpoint):
    """greedy_tokens takes the maximum of the quantized head's bf16 output itself (no float32 copy):
    the same tokens as compute_logits' argmax, ties (rows of equal logits) to the first index."""
    folder = tiny_checkpoint("llama_gqa_untied").folder
    model = load_model(folder, dtype="bfloat16", quantization="int8").model
    model.prepack_for_cpu(16)
    assert isinstance(model._packed_lm_head, QuantLinear)
    hidden = torch.randn(5, model.config.hidden_size).to(torch.bfloat16)
    hidden[3] = 0  # every logit 0: a tie across the whole vocabulary
    assert torch.equal(model.greedy_tokens(hidden), model.compute_logits(hidden).max(dim=-1).indices)
    assert model.greedy_tokens(hidden)[3] == 0
