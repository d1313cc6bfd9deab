"""A LoRA adapter (PEFT's format, rank 8 on the attention projections, B = 0 as PEFT initializes it)
for the model folder argv[1], written to argv[2]: what the tests' hub LoRA names (`*-lora`) resolve
to in run.sh's offline cache. Runs in pagedllm's interpreter (peft, transformers)."""

import sys

from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
get_peft_model(model, config).save_pretrained(sys.argv[2])
