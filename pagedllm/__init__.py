"""pagedllm: LLM inference and serving with a paged KV cache."""

from pagedllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["SamplingParams", "__version__"]
