"""Long context through the whole engine: a sliding-window model gives its old blocks back while it
generates and still produces the tokens it would with every block kept; an unset max_model_len
fits the KV budget and the start-up line says so; the window comes from every layer of the model."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.model.config import ModelConfig
from pagedllm.utils import cdiv
from tests.conftest import requires_default_model

WINDOW, BLOCK_SIZE, NUM_TOKENS = 32, 8, 2000


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    # Thousands of tiny steps: OpenMP threads spin-waiting for each other on a busy machine cost
    # more than they save (as in tests/model).
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def mistral_window_32(tmp_path_factory):
    """A tiny Mistral whose every layer attends to the last 32 tokens, long enough for 2,000."""
    pytest.importorskip("transformers")
    from tests.model.tiny import make_hf_model, save_checkpoint

    hf_model = make_hf_model("mistral_linear_rope_window", sliding_window=WINDOW,
                             max_position_embeddings=4096)
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("mistral-window"))


def generate_tracking_blocks(engine: LLMEngine, prompt: list[int]) -> tuple[list[int], list[int]]:
    """Greedy tokens of one request, and the blocks in use at every step (after scheduling)."""
    engine.add_request("r", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    used, final = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
        used.append(engine.stats().step_num_used_blocks)
    return final.outputs[0].token_ids, used


def test_a_sliding_window_model_holds_five_blocks_over_2000_tokens_and_generates_the_same(
        mistral_window_32, monkeypatch):
    prompt = list(range(40, 60))
    # Six blocks hold any length, in steps of at most 8 tokens: 8 new + 31 older keys span 6. A
    # decode step of one token holds 5 (no decode bursts here: a burst's step takes 8 slots).
    freeing = LLMEngine(model=str(mistral_window_32), dtype="float32", block_size=BLOCK_SIZE,
                        num_kv_blocks=6, max_num_batched_tokens=8, decode_burst=1)
    assert freeing.kv_plan.sliding_window == WINDOW
    assert freeing.kv_plan.max_model_len == 4096
    tokens, used = generate_tracking_blocks(freeing, prompt)
    assert len(tokens) == NUM_TOKENS
    decode_steps = used[cdiv(len(prompt), 8):]
    assert max(decode_steps) == cdiv(WINDOW, BLOCK_SIZE) + 1 == 5
    assert used[-1] <= 5 and freeing.memory_stats()["num_used_blocks"] == 0
    # Decode bursts of 8 (pagedllm.engine.decode_burst) in the same six blocks: the same tokens.
    bursting = LLMEngine(model=str(mistral_window_32), dtype="float32", block_size=BLOCK_SIZE,
                         num_kv_blocks=6, max_num_batched_tokens=8, decode_burst=8)
    burst_tokens, burst_used = generate_tracking_blocks(bursting, prompt)
    assert burst_tokens == tokens and max(burst_used) == 6 and len(burst_used) < len(used) // 4
    assert bursting.memory_stats()["num_used_blocks"] == 0

    # The same model with every block kept to the end.
    monkeypatch.setattr(ModelConfig, "kv_window", property(lambda self: None))
    keeping = LLMEngine(model=str(mistral_window_32), dtype="float32", block_size=BLOCK_SIZE,
                        num_kv_blocks=cdiv(len(prompt) + NUM_TOKENS, BLOCK_SIZE))
    assert keeping.kv_plan.sliding_window is None
    kept_tokens, kept_used = generate_tracking_blocks(keeping, prompt)
    assert kept_used[-1] == cdiv(len(prompt) + NUM_TOKENS - 1, BLOCK_SIZE)
    assert tokens == kept_tokens


def test_an_explicit_max_model_len_fits_a_window_model_by_window_plus_step(mistral_window_32):
    """Issue 32, finding 2: 16 blocks of 8 hold a 32-token window plus one step, so
    max_model_len=2100 starts (it used to need 263 blocks), a 100-token prompt is prefilled in
    chunks the cache holds, and the tokens are those of a run with every block kept."""
    prompt = [40 + i % 50 for i in range(100)]
    tight = LLMEngine(model=str(mistral_window_32), dtype="float32", block_size=BLOCK_SIZE,
                      num_kv_blocks=16, max_model_len=2100, max_num_batched_tokens=2100)
    assert (tight.kv_plan.max_model_len, tight.kv_plan.blocks_per_request) == (2100, 16)
    tokens, used = generate_tracking_blocks(tight, prompt)
    assert len(tokens) == NUM_TOKENS and max(used) <= 16
    roomy = LLM(str(mistral_window_32), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=300,
                kv_layout="contiguous", max_model_len=2100)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    kept = roomy.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens == kept


def test_two_window_requests_reuse_each_others_freed_blocks(mistral_window_32):
    """Ten blocks for two requests of over 300 tokens: they only fit because each gives blocks
    back, which the other then takes and overwrites."""
    prompts = [list(range(40, 50)), list(range(60, 75))]
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    tight = LLM(str(mistral_window_32), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=10,
                max_num_batched_tokens=16, enable_prefix_caching=False)
    roomy = LLM(str(mistral_window_32), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=100,
                kv_layout="contiguous", max_model_len=320)
    together = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    alone = [roomy.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == alone
    assert tight.memory_stats()["num_preemptions"] == 0


@requires_default_model
def test_an_unset_max_model_len_fits_a_20mib_budget_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm.engine.llm_engine"):
        llm = LLM(kv_cache_memory="20MiB")
    plan = llm.engine.kv_plan
    assert plan.fitted and plan.max_model_len == plan.num_blocks * plan.block_size
    assert plan.max_model_len < plan.model_max_len == 8192
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))
    assert (f"max_model_len={plan.max_model_len} (the longest request this KV budget holds; "
            f"the model allows 8192") in line
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=f"maximum context length is {plan.max_model_len} tokens"):
        llm.generate([[1] * (plan.max_model_len + 1)], use_tqdm=False)


def test_an_explicit_max_model_len_that_cannot_fit_still_fails_at_start(mistral_window_32):
    with pytest.raises(ValueError, match="max_model_len=4096 needs .* raise kv_cache_memory"):
        LLM(str(mistral_window_32), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=6,
            max_model_len=4096, kv_layout="contiguous")


def hf_config(**overrides) -> dict:
    config = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 300, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "sliding_window": 16, "use_sliding_window": True,
              "max_window_layers": 0}
    return {key: value for key, value in {**config, **overrides}.items() if value is not None}


@pytest.mark.parametrize("overrides, window", [
    ({}, 16),  # Qwen2 with max_window_layers 0: every layer windowed
    ({"max_window_layers": 2}, None),  # its first two layers attend to everything
    ({"use_sliding_window": False}, None),
    ({"architectures": ["MistralForCausalLM"]}, 16),
    # Gemma 2: global every other layer
    ({"architectures": ["Gemma2ForCausalLM"], "use_sliding_window": None, "max_window_layers": None},
     None),
    ({"architectures": ["LlamaForCausalLM"]}, None),  # Llama's models ignore the key
])
def test_the_window_that_frees_blocks_is_every_layers(overrides, window):
    config = ModelConfig.from_hf_config(hf_config(**overrides))
    assert config.kv_window == window
    if window is not None:
        assert all(config.layer_window(i) == window for i in range(config.num_hidden_layers))
