"""The same weights in Hugging Face transformers, for baselines and equivalence tests."""

from __future__ import annotations

from pathlib import Path

import torch


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """transformers' own model for a HF folder or a .gguf file. A GGUF goes through
    transformers' GGUF conversion directly: from_pretrained(gguf_file=...) would also need
    `accelerate`, which this project does not install."""
    import transformers

    path = Path(path)
    if path.suffix != ".gguf":
        return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if not set(missing) <= {"lm_head.weight"} or unexpected:  # lm_head may be tied
        raise ValueError(f"{path}: transformers' conversion left missing={missing[:5]} "
                         f"unexpected={unexpected[:5]}")
    model.tie_weights()
    return model.to(dtype).eval()
