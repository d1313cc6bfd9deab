"""Tiny random PEFT LoRA adapters over tests/model/tiny.py's bases, and the merged references."""

from __future__ import annotations

import torch


def make_adapter(hf_model, folder, targets, rank, rslora, seed):
    """Save a PEFT adapter with random (not zero) B, so that it changes the logits; (its folder,
    the base with the adapter merged in)."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, use_rslora=rslora)
    torch.manual_seed(seed)
    model = peft.get_peft_model(hf_model, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn_like(param))
    model.save_pretrained(folder)
    merged = model.merge_and_unload()
    return folder, merged


@torch.inference_mode()
def greedy_reference(hf_model, prompt: list[int], num_tokens: int) -> list[int]:
    """num_tokens greedy tokens of a transformers model, one full forward per token (float32)."""
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
