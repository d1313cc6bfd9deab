"""How each supported model family departs from Llama, in one table.

Every family here is a Llama at heart: pre-norm decoder layers of rotary attention and a gated
MLP. A row says what a family changes; the model code reads these flags, and the config parsers
(config.json, GGUF metadata) fill in the numbers that vary by checkpoint (windows, soft-caps,
rope bases).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch.nn.functional as F


@dataclass(frozen=True)
class Architecture:
    # general.architecture in the GGUF files llama.cpp writes for this family (None: none of its
    # own; Mistral files say "llama").
    gguf_name: str | None = None
    qkv_bias: bool = False  # bias on q/k/v and none on o_proj, whatever the config says (Qwen2)
    qk_norm: bool = False  # an RMSNorm over each head of q and of k, before rotary
    # Norms on the attention and MLP outputs too, before each residual add ("sandwich").
    sandwich_norms: bool = False
    # The RMSNorm weights are stored as offsets: the scale is (norm_offset + weight).
    norm_offset: float = 0.0
    scaled_embeddings: bool = False  # embeddings are multiplied by sqrt(hidden_size)
    # q/k/v and gate/up are stored already fused, as qkv_proj and gate_up_proj.
    fused_checkpoint: bool = False
    hidden_act: str = "silu"  # the MLP's gate activation where config.json does not name one
    sliding_window: bool = True  # honours config.json's sliding_window (Llama's models ignore it)
    # Which layers use the sliding window when the checkpoint does not list them: every layer
    # (None), or all but every period-th layer (Gemma: period 2, layers 0, 2, 4... slide).
    sliding_period: int | None = None
    # The rope base of the sliding-window layers where the checkpoint does not say (Gemma 3).
    local_rope_theta: float | None = None
    # The shared expert's output is scaled by sigmoid(shared_expert_gate(x)), a learned gate of one
    # output (Qwen2-MoE), before it joins the routed experts'.
    shared_expert_gate: bool = False
    # A learned logit per attention head that joins each softmax's denominator and adds no value
    # (gpt-oss's "sinks"): a query may give part of its attention to nothing.
    attention_sinks: bool = False
    # YaRN's ramp between kept and interpolated frequencies starts and ends on whole dimensions,
    # where the GGUF file does not say (gpt-oss was trained without that rounding).
    yarn_truncate: bool = True


_GEMMA = dict(sandwich_norms=True, norm_offset=1.0, scaled_embeddings=True,
              hidden_act="gelu_pytorch_tanh")

# Hugging Face architecture class name -> what it changes.
ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(gguf_name="llama", sliding_window=False),
    "MistralForCausalLM": Architecture(),
    "Qwen2ForCausalLM": Architecture(gguf_name="qwen2", qkv_bias=True),
    "Qwen3ForCausalLM": Architecture(gguf_name="qwen3", qk_norm=True),
    # Mixtures of experts (model/moe.py); Mixtral's GGUF files say "llama" with expert tensors.
    "Qwen3MoeForCausalLM": Architecture(gguf_name="qwen3moe", qk_norm=True),
    "MixtralForCausalLM": Architecture(),
    # Qwen2's attention (q/k/v bias, unless config.json's qkv_bias says none) and a gated shared
    # expert beside the routed ones.
    "Qwen2MoeForCausalLM": Architecture(gguf_name="qwen2moe", qkv_bias=True, shared_expert_gate=True),
    # Multi-head latent attention (model/mla.py) and mixtures of experts with shared experts.
    # llama.cpp writes both as deepseek2 (config.py tells V3 by its sigmoid router).
    "DeepseekV2ForCausalLM": Architecture(gguf_name="deepseek2", sliding_window=False),
    "DeepseekV3ForCausalLM": Architecture(sliding_window=False),
    # Hybrid: Gated DeltaNet layers with a gated full-attention layer every few (model/hybrid.py);
    # its RMSNorms scale by 1 + weight.
    "Qwen3_5ForCausalLM": Architecture(qk_norm=True, norm_offset=1.0, sliding_window=False),
    # Hybrid: Mamba2 layers with a few attention layers, a shared MLP beside routed experts (or
    # alone), and Granite's scalings (model/granite_hybrid.py).
    "GraniteMoeHybridForCausalLM": Architecture(gguf_name="granitehybrid", sliding_window=False),
    "Gemma2ForCausalLM": Architecture(gguf_name="gemma2", sliding_period=2, **_GEMMA),
    "Gemma3ForCausalLM": Architecture(gguf_name="gemma3", qk_norm=True, sliding_period=6,
                                      local_rope_theta=10000.0, **_GEMMA),
    "Phi3ForCausalLM": Architecture(gguf_name="phi3", fused_checkpoint=True),
    # Attention sinks, windowed and full layers alternating (layers 0, 2, 4... slide), biases on
    # q/k/v/o; a mixture of experts with biases everywhere (config_parts.py's _GPT_OSS_MOE says how
    # it routes and gates).
    "GptOssForCausalLM": Architecture(gguf_name="gpt-oss", attention_sinks=True, sliding_period=2,
                                      yarn_truncate=False),
}

# GGUF general.architecture -> the Hugging Face class it stands for.
GGUF_ARCHITECTURES = {arch.gguf_name: name for name, arch in ARCHITECTURES.items()
                      if arch.gguf_name is not None}

# The MLP gate activations, by the names config.json uses.
ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}
