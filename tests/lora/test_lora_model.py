"""LoRA adapters in the model: one batch mixing the base model and several adapters gives, for each
sequence, the logits of transformers with PEFT's merged weights for its adapter (float32); slots
are freed to nothing; bad adapters are refused in one line naming them."""

from __future__ import annotations

import json
import random

import pytest
import torch

from pagedllm.lora.adapter import LoRAAdapter, LoRAError
from pagedllm.lora.layers import wrap_model
from pagedllm.lora.manager import LoRAManager
from pagedllm.model.loader import load_model
from tests.lora.adapters import make_adapter
from tests.model.paged import PagedSequences
from tests.model.tiny import make_hf_model, save_checkpoint

peft = pytest.importorskip("peft")

TARGETS = {
    "attn": (["q_proj", "v_proj", "o_proj"], 4, False),
    "mlp": (["gate_proj", "up_proj", "down_proj", "k_proj"], 8, True),  # rsLoRA scaling
    "vocab": (["embed_tokens", "lm_head", "q_proj"], 4, False),
}


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = save_checkpoint(make_hf_model("llama_gqa_untied", seed=3), root / "base")
    merged = {}
    for i, (name, (targets, rank, rslora)) in enumerate(TARGETS.items()):
        folder, model = make_adapter(make_hf_model("llama_gqa_untied", seed=3), root / name, targets,
                                     rank, rslora, seed=10 + i)
        merged[name] = (folder, model.eval())
    return base, merged, make_hf_model("llama_gqa_untied", seed=3).eval()


def ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


@torch.inference_mode()
def test_a_batch_mixing_adapters_gives_each_its_merged_logits(base_and_adapters):
    base, merged, hf_base = base_and_adapters
    model = load_model(base, dtype="float32").model
    state, wrapped = wrap_model(model, max_loras=3, max_rank=8)
    manager = LoRAManager(state, wrapped, max_loras=3, max_rank=8)
    slots = {name: manager.add(LoRAAdapter.load(name, folder, model.config, 8))
             for name, (folder, _) in merged.items()}
    sequences = {0: (ids(9, 1), -1), 1: (ids(7, 2), slots["attn"]), 2: (ids(11, 3), slots["mlp"]),
                 3: (ids(5, 4), slots["attn"]), 4: (ids(6, 7), slots["vocab"])}
    paged = PagedSequences(model, num_blocks=24, block_size=4)
    token_slots = [slot for tokens, slot in sequences.values() for _ in tokens]
    state.set_batch(token_slots)
    ours = paged.step({seq: tokens for seq, (tokens, _) in sequences.items()})
    for seq, (tokens, slot) in sequences.items():
        reference = hf_base if slot < 0 else merged[next(n for n, s in slots.items() if s == slot)][1]
        expected = reference(torch.tensor([tokens])).logits[0]
        torch.testing.assert_close(ours[seq], expected, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_an_unloaded_slot_adds_nothing_and_is_reused(base_and_adapters):
    base, merged, hf_base = base_and_adapters
    model = load_model(base, dtype="float32").model
    state, wrapped = wrap_model(model, max_loras=1, max_rank=8)
    manager = LoRAManager(state, wrapped, max_loras=1, max_rank=8)
    slot = manager.add(LoRAAdapter.load("attn", merged["attn"][0], model.config, 8))
    with pytest.raises(LoRAError, match="all 1 slots are taken"):
        manager.add(LoRAAdapter.load("mlp", merged["mlp"][0], model.config, 8))
    manager.remove("attn")
    assert all(not m.lora_a.any() and not m.lora_b.any() for m in wrapped.values())
    tokens = ids(6, 5)
    state.set_batch([slot] * len(tokens))  # a stale mapping to the freed slot: the base's logits
    logits = PagedSequences(model, num_blocks=4, block_size=4).step({0: tokens})[0]
    torch.testing.assert_close(logits, hf_base(torch.tensor([tokens])).logits[0], atol=1e-4, rtol=1e-4)
    assert manager.add(LoRAAdapter.load("mlp", merged["mlp"][0], model.config, 8)) == slot


@torch.inference_mode()
def test_embedding_and_head_adapters_on_a_tied_base(tmp_path):
    """On a base whose LM head is its embedding matrix, adapters of each stay their own (PEFT's
    unmerged forward: merging would write one into the other's weight), and head rows picked from
    the batch (the runner's sampled rows) get their own adapters' updates."""
    def tied():
        return make_hf_model("llama_gqa_untied", seed=4, tie_word_embeddings=True)

    hf_base = tied().eval()
    assert hf_base.config.tie_word_embeddings
    base = save_checkpoint(hf_base, tmp_path / "base")
    folder, _ = make_adapter(tied(), tmp_path / "vocab",
                             ["embed_tokens", "lm_head"], 4, False, seed=3)
    reference = peft.PeftModel.from_pretrained(tied(), folder).eval()
    model = load_model(base, dtype="float32").model
    state, wrapped = wrap_model(model, max_loras=2, max_rank=4)
    slot = LoRAManager(state, wrapped, 2, 4).add(LoRAAdapter.load("vocab", folder, model.config, 4))
    first, second = ids(7, 8), ids(5, 9)
    paged = PagedSequences(model, num_blocks=8, block_size=4)
    state.set_batch([slot] * len(first) + [-1] * len(second))
    ours = paged.step({0: first, 1: second})
    torch.testing.assert_close(ours[0], reference(torch.tensor([first])).logits[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours[1], hf_base(torch.tensor([second])).logits[0], atol=1e-4, rtol=1e-4)
    # The head's rows a subset, as the runner samples them: the last token of each, in turn.
    hidden = torch.randn(2, model.config.hidden_size)
    state.select_rows([len(first) + len(second) - 1, len(first) - 1])
    mixed = model.compute_logits(hidden)
    state.set_batch([-1, -1])
    plain = model.compute_logits(hidden)
    torch.testing.assert_close(mixed[0], plain[0])  # the base's row: nothing added
    assert not torch.allclose(mixed[1], plain[1], atol=1e-2)  # the adapter's row: its update


def test_bad_adapters_are_refused_naming_them(base_and_adapters, tmp_path):
    base, merged, _ = base_and_adapters
    config = load_model(base, dtype="float32").config
    folder = merged["mlp"][0]
    with pytest.raises(LoRAError, match="'big': rank 8 exceeds --max-lora-rank 4"):
        LoRAAdapter.load("big", folder, config, 4)
    other = make_hf_model("llama_gqa_untied", hidden_size=32, intermediate_size=48)
    wrong_base, _ = make_adapter(other, tmp_path / "other", ["q_proj"], 4, False, seed=1)
    with pytest.raises(LoRAError, match="'other': tensor .* has shape .* another base model"):
        LoRAAdapter.load("other", wrong_base, config, 8)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((folder / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(LoRAError, match="'corrupt': cannot read .* damaged"):
        LoRAAdapter.load("corrupt", corrupt, config, 8)
    strange = tmp_path / "strange"
    strange.mkdir()
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (strange / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["lm_head"]}))
    from safetensors.torch import save_file
    save_file({"base_model.model.model.norm.lora_A.weight": torch.zeros(8, 64)},
              strange / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match="'strange': tensor base_model.model.model.norm.lora_A.weight"):
        LoRAAdapter.load("strange", strange, config, 8)
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)},
              strange / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match="'strange': lm_head has lora_B missing"):
        LoRAAdapter.load("strange", strange, config, 8)
    resized = {"base_model.model.model.embed_tokens.base_layer.weight": torch.zeros(301, 64),
               "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
               "base_model.model.lm_head.lora_B.weight": torch.zeros(300, 8)}
    save_file(resized, strange / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match="'strange': .* shape \\(301, 64\\).* resized vocabulary"):
        LoRAAdapter.load("strange", strange, config, 8)
    (strange / "adapter_config.json").write_text(json.dumps({**cfg, "trainable_token_indices": [5]}))
    with pytest.raises(LoRAError, match="'strange': trainable_token_indices is not supported"):
        LoRAAdapter.load("strange", strange, config, 8)


@pytest.mark.parametrize("adapter", ["mlp", "vocab"])
@pytest.mark.parametrize("dtype,quantization", [("bfloat16", "none"), ("float32", "int8"),
                                                ("bfloat16", "int4")])
@torch.inference_mode()
def test_bf16_and_quantized_bases_take_adapters_too(base_and_adapters, dtype, quantization, adapter):
    """Beside a bf16 (prepacked on the CPU) or quantized base, the updates run in the model's
    dtype: the logits' mean distance from PEFT's merged float32 ones is of the order of the base's
    own rounding (its distance from transformers' base), and far below what the adapter changes.
    Means, not maxima: an adapter on the LM head maps the hidden states' own rounding straight into
    the logits through its (large, random) update, so a few logits of int4's coarse tiny model
    move up to 4.7 where the base's move 1.8 (its mean 0.73 against 0.31)."""
    from pagedllm.worker.runner import ModelRunner

    base, merged, hf_base = base_and_adapters
    model = load_model(base, dtype=dtype, quantization=quantization).model
    runner = ModelRunner(model, num_blocks=16, block_size=4, max_num_batched_tokens=64, max_model_len=64,
                         kv_dtype=model.norm.weight.dtype, lora=(2, 8))  # wraps, then prepacks
    manager = runner.lora_manager
    slot = manager.add(LoRAAdapter.load(adapter, merged[adapter][0], model.config, 8))
    tokens = ids(12, 6)
    batch = torch.tensor([tokens])
    expected, without = merged[adapter][1](batch).logits[0], hf_base(batch).logits[0]
    errors = {}
    for name, slots, reference in (("lora", [slot], expected), ("base", [-1], without)):
        manager.state.set_batch(slots * len(tokens))
        ours = PagedSequences(model, num_blocks=8, block_size=4).step({0: tokens})[0].float()
        errors[name] = (ours - reference).abs().mean().item()
    effect = (without - expected).abs().mean().item()
    assert errors["lora"] < 3 * errors["base"] + 0.01 and errors["lora"] < effect / 2, (errors, effect)
