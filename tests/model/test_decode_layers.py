"""Decode steps through every layer in one compiled call (model/decode_layers.py) give bit for bit
the logits of the layer-by-layer path, on the tiers that compile it; models that do not qualify
keep the layers' path; the engine's greedy text is the same with the switch off."""

from __future__ import annotations

import gguf
import pytest
import torch

from pagedllm.model.decode_layers import DecodeLayers
from pagedllm.model.loader import load_model
from tests.kernel_tiers import COMPILED_TIERS, kernel_tier
from tests.model.paged import PagedSequences
from tests.model.tiny import make_hf_model, write_gguf

Q = gguf.GGMLQuantizationType
PROMPTS = {0: [5, 9, 20, 33, 41, 7, 7, 100, 3, 18, 2], 1: [77, 1, 250], 2: [12] * 19}


def _gguf(tmp_path):
    """A tiny Llama GGUF in the default model's layouts (Q4_1 layers, a Q8_0 head) but for v in
    Q8_0: a fused q/k/v of two parts."""
    hf_model = make_hf_model("llama_gqa_untied")
    names = {"output.weight": Q.Q8_0}
    for i in range(hf_model.config.num_hidden_layers):
        for part in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            names[f"blk.{i}.{part}.weight"] = Q.Q4_1
        names[f"blk.{i}.attn_v.weight"] = Q.Q8_0
    return write_gguf(hf_model, tmp_path / "q4_1.gguf", quantize=names)


def _load(source: str, tmp_path, tiny_checkpoint, dtype: str):
    if source == "gguf":
        return load_model(_gguf(tmp_path), dtype=dtype).model
    shape, quantization = source.split(":")
    return load_model(tiny_checkpoint(shape).folder, dtype=dtype, quantization=quantization).model


def _steps(model, kv_cache_dtype: str, fused: bool, calls: list,
           lora_slots: dict | None = None) -> list[torch.Tensor]:
    """Every step's logits: a prefill of three prompts, then decodes of 3, 2 and 1 rows (lora_slots:
    each sequence's adapter slot, set for every step's tokens)."""
    paged = PagedSequences(model, num_blocks=64, block_size=4, kv_cache_dtype=kv_cache_dtype)
    if lora_slots is not None:
        plain_step = paged.step

        def step_with_slots(batch):
            state.set_batch([lora_slots[i] for i, tokens in batch.items() for _ in tokens])
            return plain_step(batch)
        state = model.layers[0].self_attn.qkv_proj.state
        paged.step = step_with_slots
    model.decode_layers = DecodeLayers.build(model, paged.kv_caches) if fused else None
    if fused:
        assert model.decode_layers is not None, "this model should qualify"
        run = model.decode_layers.run
        model.decode_layers.run = lambda *a: calls.append(1) or run(*a)
    logits = paged.step(PROMPTS)
    out = [torch.cat(list(logits.values()))]
    tokens = {i: [int(rows[-1].argmax())] for i, rows in logits.items()}
    for step in range(9):
        seqs = list(tokens)[: 3 - step // 3]
        logits = paged.step({i: tokens[i][-1:] for i in seqs})
        out.append(torch.cat(list(logits.values())))
        for i in seqs:
            tokens[i].append(int(logits[i][-1].argmax()))
    return out


@pytest.mark.parametrize("source", ["gguf", "qwen2_qkv_bias:int4", "mistral_linear_rope_window:int8",
                                    "qwen3_qk_norm:int4", "qwen3_moe:int8", "mixtral_moe:int4",
                                    "qwen2_moe:int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_one_call_equals_the_layers(tier, source, dtype, kv_cache_dtype, tmp_path, tiny_checkpoint):
    model = _load(source, tmp_path, tiny_checkpoint, dtype)
    paged = PagedSequences(model, num_blocks=8, block_size=4)
    if not tier_runs_it():
        assert DecodeLayers.build(model, paged.kv_caches) is None
        return
    calls: list = []
    fused = _steps(model, kv_cache_dtype, True, calls)
    assert len(calls) == 9  # every decode step, not the prefill
    layered = _steps(model, kv_cache_dtype, False, [])
    for a, b in zip(fused, layered, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_three_picks_of_renormalized_experts_sum_as_the_layers_do(tier, dtype, tmp_path):
    """The call sums a token's picks itself: with three (the order of an fp32 sum matters then)
    and renormalized weights, still bit for bit the layers' torch sum."""
    from tests.model.tiny import save_checkpoint

    folder = save_checkpoint(make_hf_model("qwen3_moe", num_experts_per_tok=3, norm_topk_prob=True),
                             tmp_path / "top3")
    model = load_model(folder, dtype=dtype, quantization="int8").model
    if not tier_runs_it():
        return
    calls: list = []
    fused = _steps(model, "auto", True, calls)
    assert len(calls) == 9
    for a, b in zip(fused, _steps(model, "auto", False, []), strict=True):
        assert torch.equal(a, b)


def test_one_call_adds_lora_updates_as_the_layers_do(tier, tmp_path, tiny_checkpoint):
    """Projections wrapped for LoRA (their updates by csrc/lora.cpp): the same logits in one call,
    two adapters and the base mixed in each step."""
    from pagedllm.lora.adapter import MODEL_WIDE
    from pagedllm.lora.layers import wrap_model

    model = _load("gguf", tmp_path, tiny_checkpoint, "float32")
    if not tier_runs_it():
        return
    _, wrapped = wrap_model(model, max_loras=2, max_rank=4)
    gen = torch.Generator().manual_seed(0)
    for (index, _), layer in wrapped.items():
        if index == MODEL_WIDE:  # the embeddings and the LM head: outside the layers' one call
            continue
        for slot in range(2):
            parts = {p: (torch.randn(4, layer.lora_a.shape[2], generator=gen) * 0.1,
                         torch.randn(rows, 4, generator=gen) * 0.1) for p, rows in enumerate(layer.part_rows)}
            layer.set_slot(slot, parts, scaling=1.0)
    slots = {0: 1, 1: -1, 2: 0}
    calls: list = []
    fused = _steps(model, "auto", True, calls, slots)
    assert len(calls) == 9
    layered = _steps(model, "auto", False, [], slots)
    base = _steps(model, "auto", False, [], {0: -1, 1: -1, 2: -1})
    assert not torch.equal(fused[-1], base[-1])  # the adapters change the logits
    for a, b in zip(fused, layered, strict=True):
        assert torch.equal(a, b)


def tier_runs_it() -> bool:
    from pagedllm.kernels import tiers

    return tiers.current().decode_layers


@pytest.mark.parametrize("shape,quantization", [("phi4_partial_rotary", "int8"),
                                                ("gemma2_softcap_window", "int8"),
                                                ("llama_gqa_untied", "none"), ("deepseek_v2_mla", "int8"),
                                                ("gpt_oss", "int8")])
def test_models_that_do_not_qualify_keep_the_layers(shape, quantization, tiny_checkpoint):
    """Partial rotary, sandwich norms, float weights, latent attention with shared experts,
    attention sinks: no packed layers."""
    with kernel_tier(COMPILED_TIERS[-1] if COMPILED_TIERS else "portable"):
        model = load_model(tiny_checkpoint(shape).folder, dtype="float32", quantization=quantization).model
        assert DecodeLayers.build(model, PagedSequences(model, num_blocks=8, block_size=4).kv_caches) is None


def test_attention_sinks_alone_keep_a_model_out(tier, tmp_path, tiny_checkpoint):
    """The compiled attention has no sinks: a model that qualifies stops qualifying once its
    attention has them (gpt-oss's other departures, its router bias and clamped SwiGLU, aside)."""
    model = _load("gguf", tmp_path, tiny_checkpoint, "float32")
    caches = PagedSequences(model, num_blocks=8, block_size=4).kv_caches
    if not tier_runs_it():
        return
    assert DecodeLayers.build(model, caches) is not None
    for layer in model.layers:
        layer.self_attn.sinks = torch.nn.Parameter(torch.zeros(layer.self_attn.num_heads))
    assert DecodeLayers.build(model, caches) is None


def greedy_with_switch_on_and_off(tmp_path, monkeypatch, variable: str, check_model) -> list:
    """The tiny GGUF's greedy tokens and logprobs through the engine with the switch `variable`
    set to 1, then 0; check_model(model, on) looks at the runner's model first."""
    from pagedllm import LLM, SamplingParams

    path = _gguf(tmp_path)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS.values()]
    results = []
    for switch in ("1", "0"):
        monkeypatch.setenv(variable, switch)
        llm = LLM(str(path), dtype="bfloat16", enable_prefix_caching=False)
        check_model(llm.engine.engine_core.executor.runner.model, switch == "1")
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs)
                        for o in llm.generate(prompts, params, use_tqdm=False)])
    return results


def test_engine_text_is_the_same_with_the_switch_off(tmp_path, monkeypatch):
    """Through the engine (the runner builds the packed layers): greedy text and logprobs equal
    with PAGEDLLM_DECODE_LAYERS=0."""
    def packed_where_on(model, on):
        assert (model.decode_layers is not None) == (on and tier_runs_it())

    on, off = greedy_with_switch_on_and_off(tmp_path, monkeypatch, "PAGEDLLM_DECODE_LAYERS", packed_where_on)
    assert on == off
