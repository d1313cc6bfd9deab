"""Batch-invariant mode: greedy bf16 outputs (tokens and their log-probabilities, bit for bit) are
the same for a request alone and in a busy engine (other requests, chunked prefill, preemption
and recompute); what the mode does not cover is refused at start-up."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.kernels import tiers
from pagedllm.model.batch_invariant import INVARIANT_ROWS, InvariantLinear
from tests.conftest import requires_default_model
from tests.model.tiny import make_hf_model, save_checkpoint

pytestmark = pytest.mark.skipif(not tiers.current().runs_layers,
                                reason="batch-invariant mode needs the compiled CPU kernels")

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    model = make_hf_model("llama_gqa_untied", max_position_embeddings=512, hidden_size=128,
                          intermediate_size=256)
    return save_checkpoint(model, tmp_path_factory.mktemp("tiny_bf16"))


@pytest.fixture(scope="module")
def window_folder(tmp_path_factory):
    model = make_hf_model("mistral_linear_rope_window", max_position_embeddings=512, sliding_window=20)
    return save_checkpoint(model, tmp_path_factory.mktemp("tiny_window"))


def random_prompts(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(256) for _ in range(rng.randrange(5, 150))]}
            for _ in range(count)]


def greedy(llm: LLM, prompts) -> list[tuple[list[int], list[float]]]:
    """Each output's tokens and their log-probabilities."""
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
            for o in outputs]


def alone_and_busy(folder, **engine_args):
    """Every prompt alone on a roomy engine, then all at once on a busy one: prompts cut into
    chunks of 64 tokens, and too few blocks for all of them (preemption by recompute)."""
    prompts = random_prompts(16)
    roomy = LLM(str(folder), dtype="bfloat16", kv_cache_memory="64MiB", batch_invariant=True,
                **engine_args)
    alone = [greedy(roomy, [p])[0] for p in prompts]
    busy = LLM(str(folder), dtype="bfloat16", num_kv_blocks=30, block_size=16, max_model_len=256,
               max_num_batched_tokens=64, enable_prefix_caching=False, batch_invariant=True,
               **engine_args)
    together = greedy(busy, prompts)
    assert busy.memory_stats()["num_preemptions"] > 0
    return alone, together


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_bf16_greedy_alone_equals_busy(tiny_folder, kv_cache_dtype):
    alone, together = alone_and_busy(tiny_folder, kv_cache_dtype=kv_cache_dtype)
    assert together == alone


def test_bf16_greedy_alone_equals_busy_with_a_sliding_window(window_folder):
    alone, together = alone_and_busy(window_folder)
    assert together == alone


@requires_default_model
def test_default_model_alone_equals_batched_and_chunked():
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
               "Water boils at a temperature of"]
    llm = LLM(kv_cache_memory="64MiB", max_model_len=256, max_num_batched_tokens=16,
              enable_prefix_caching=False, batch_invariant=True)
    assert llm.engine.dtype == torch.bfloat16
    alone = [greedy(llm, [p])[0] for p in prompts]
    assert greedy(llm, prompts + prompts[::-1]) == alone + alone[::-1]


def test_invariant_linear_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
    layer = InvariantLinear(weight, bias)
    x = torch.randn(3 * INVARIANT_ROWS + 5, 64).bfloat16()
    batch = layer(x)
    for i in (0, INVARIANT_ROWS - 1, INVARIANT_ROWS, len(x) - 1):
        assert torch.equal(layer(x[i:i + 1]), batch[i:i + 1])
    torch.testing.assert_close(batch, F.linear(x, weight, bias))


def test_uncovered_combinations_are_refused(tiny_folder, monkeypatch):
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(device="cuda", batch_invariant=True)
    with pytest.raises(ValueError, match="bfloat16 and float32"):
        LLM(str(tiny_folder), dtype="float16", kv_cache_memory="16MiB", batch_invariant=True)
    with pytest.raises(ValueError, match="one process"):
        EngineConfig(tensor_parallel_size=2, batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant must be true or false"):
        EngineConfig(batch_invariant="yes")
    monkeypatch.setattr(tiers.KernelChoice, "runs_layers", property(lambda self: False))
    with pytest.raises(ValueError, match="compiled CPU kernels"):
        LLM(str(tiny_folder), dtype="bfloat16", kv_cache_memory="16MiB", batch_invariant=True)


def test_a_model_with_attention_sinks_is_refused(tmp_path):
    """gpt-oss's sinks run on the torch attention path, which the mode does not cover."""
    folder = save_checkpoint(make_hf_model("gpt_oss"), tmp_path / "gpt_oss")
    with pytest.raises(ValueError, match="attention sinks run on the torch attention path"):
        LLM(str(folder), dtype="bfloat16", kv_cache_memory="16MiB", batch_invariant=True)


def test_the_engine_flag_sets_it():
    from pagedllm.cli import build_parser
    from pagedllm.config import engine_config_from_args

    args = build_parser().parse_args(["generate", "hi", "--batch-invariant"])
    assert engine_config_from_args(args).batch_invariant is True
    assert engine_config_from_args(build_parser().parse_args(["generate", "hi"])).batch_invariant is False
