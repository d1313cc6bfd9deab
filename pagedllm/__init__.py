"""pagedllm: LLM inference and serving with a paged KV cache."""

from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "LoRARequest", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy, so that the pure-Python parts (kv manager, scheduler) import without torch.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pagedllm.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
